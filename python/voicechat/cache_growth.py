"""How a key/value buffer grows: by at least a quarter of what it holds, in whole chunks.

Each capacity a buffer takes is one more shape for the compiled decode steps, which MLX traces and
keeps (and on a CPU, compiles to a kernel library) for the process's life. Growing by a fixed chunk
would give an hour-long conversation about 180 shapes of the 256-slot chunk; a quarter at a time
gives about 20, for at most a quarter of the buffer held unused."""


def grown_capacity(need: int, have: int, chunk: int) -> int:
    """The new capacity of a buffer of `have` slots that must hold `need` (> have): a multiple of
    `chunk`, at least `need` and at least `have` plus a quarter."""
    target = max(need, have + have // 4)
    return -(-target // chunk) * chunk
