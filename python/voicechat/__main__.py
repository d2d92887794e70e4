"""`python -m voicechat ...` is `vc-generate ...` (for environments whose scripts are not on PATH).

`python -m voicechat --cmake-dir` prints the folder of voicechat's CMake package (find_package(voicechat
CONFIG) gives voicechat::kernels, the C++ ops: docs/kernels.md), as `python -m pybind11 --cmakedir`
does for pybind11; `--include-dir` the folder of its C++ headers."""

import sys
from pathlib import Path


def _package_dir(*parts: str) -> int:
    path = Path(__file__).resolve().parent.joinpath(*parts)
    if not path.is_dir():
        print(f"error: {path} does not exist (voicechat is not built: pip install . or tools/dev-build.sh)",
              file=sys.stderr)
        return 1
    print(path)
    return 0


if sys.argv[1:] == ["--cmake-dir"]:
    sys.exit(_package_dir("share", "cmake", "voicechat"))
if sys.argv[1:] == ["--include-dir"]:
    sys.exit(_package_dir("include"))

from .cli import main  # noqa: E402

sys.exit(main())
