/*
 * Preloaded into CRIU by tests/criu_stream.rs: sends SIGCONT to the first
 * thread CRIU resumes after seizing it in its last restore stage
 * (attach_to_tasks: PTRACE_SETOPTIONS with PTRACE_O_TRACESYSGOOD, then
 * PTRACE_CONT), as a shell's job control or a supervisor might at that
 * moment. The seized thread then stops in a ptrace trap (the kernel's
 * notice to its tracer that it was continued) while CRIU 4.2.1 waits on a
 * futex for it to reach the next stage: both wait for good, every time.
 * Nothing else of CRIU changes.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/ptrace.h>
#include <sys/types.h>

long ptrace(enum __ptrace_request request, ...)
{
	static long (*real)(enum __ptrace_request, pid_t, void *, void *);
	static pid_t armed;
	static int sent;
	va_list ap;

	va_start(ap, request);
	pid_t pid = va_arg(ap, pid_t);
	void *addr = va_arg(ap, void *);
	void *data = va_arg(ap, void *);
	va_end(ap);
	if (!real)
		real = (long (*)(enum __ptrace_request, pid_t, void *, void *))dlsym(RTLD_NEXT, "ptrace");
	long ret = real(request, pid, addr, data);
	if (!sent && request == PTRACE_SETOPTIONS && (long)data == PTRACE_O_TRACESYSGOOD) {
		armed = pid;
	} else if (!sent && request == PTRACE_CONT && pid == armed) {
		sent = 1;
		kill(pid, SIGCONT);
	}
	return ret;
}
