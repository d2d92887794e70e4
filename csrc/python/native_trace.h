// A native stack trace on a fatal signal, for crashes inside MLX or CUDA that Python's faulthandler
// shows only as Python frames (an abort on the TTS worker thread, say).
#pragma once

namespace voicechat {

// On SIGABRT, SIGSEGV, SIGBUS, SIGILL and SIGFPE: write "voicechat: native stack ..." and the
// faulting thread's frames (glibc's backtrace_symbols_fd) to stderr, then hand the signal to the
// handler that was there before (Python's faulthandler, or the default). Installed at import when
// VOICECHAT_NATIVE_TRACE=1.
void install_native_trace();

}  // namespace voicechat
