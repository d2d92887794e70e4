#include "python/native_trace.h"

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>

namespace voicechat {
namespace {

constexpr int kSignals[] = {SIGABRT, SIGSEGV, SIGBUS, SIGILL, SIGFPE};
struct sigaction previous[NSIG];

// async-signal-safe only: write(2) and backtrace (preloaded at install so that it does not
// allocate here for the first time)
const char* signal_name(int sig) {
  switch (sig) {
    case SIGABRT: return "SIGABRT";
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGILL: return "SIGILL";
    default: return "SIGFPE";
  }
}

void on_fatal(int sig, siginfo_t*, void*) {
  const char* name = signal_name(sig);
  const char head[] = "voicechat: native stack at ";
  (void)!write(STDERR_FILENO, head, sizeof(head) - 1);
  (void)!write(STDERR_FILENO, name, strlen(name));
  (void)!write(STDERR_FILENO, ":\n", 2);
  void* frames[96];
  backtrace_symbols_fd(frames, backtrace(frames, 96), STDERR_FILENO);
  sigaction(sig, &previous[sig], nullptr);
  raise(sig);  // the handler before ours (SA_NODEFER: not blocked while we run)
}

}  // namespace

void install_native_trace() {
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc's unwinder now, not inside the handler
  struct sigaction action {};
  action.sa_sigaction = on_fatal;
  action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  for (int sig : kSignals) sigaction(sig, &action, &previous[sig]);
}

}  // namespace voicechat
