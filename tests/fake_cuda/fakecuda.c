/*
 * A fake CUDA driver for criuz's tests (CI has no GPU): the driver calls criuz
 * loads from libcuda (CRIUZ_LIBCUDA names this library instead), keeping each
 * process's checkpoint state in files and recording every call.
 *
 * A process is a CUDA process when its environment holds FAKE_CUDA_ID=ID
 * (read from /proc/PID/environ, which CRIU restores with the process: like
 * the real driver's state, the identity travels with the process, whatever
 * pid a restore gives it); for any other, GetState fails as the real driver's
 * does for a process without CUDA. FAKE_CUDA_DIR holds:
 *   state-ID      its state: 0 running, 1 locked, 2 checkpointed
 *   id-PID        the id last read from PID's environment
 *   devices       GPUs, one a line: 32 hex digits of the UUID, a space, the name
 *                 (absent: one "Fake GPU" 00112233-...)
 *   fail-CALL     present: CALL (init, state, lock, checkpoint, restore, unlock)
 *                 fails with CUDA_ERROR_UNKNOWN
 *   slow-CALL     present: CALL first sleeps that many seconds (its content)
 *   log           appended: one line per call, with the caller (criuz's
 *                 subcommand), the target's /proc state letter and tracer pid
 *                 at the time of the call, and the state change
 *
 * The state machine is the driver's: lock needs running, checkpoint locked,
 * restore checkpointed (and leaves it locked), unlock locked; anything else
 * fails with CUDA_ERROR_INVALID_VALUE, so a call out of order shows.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef struct { unsigned char bytes[16]; } CUuuid;
typedef struct { CUuuid old_uuid, new_uuid; } Pair;
typedef struct { Pair *pairs; unsigned int count; char reserved[52]; } RestoreArgs;
typedef struct { unsigned int timeout_ms, reserved0; unsigned long long reserved1[7]; } LockArgs;

enum { OK = 0, INVALID_VALUE = 1, NOT_INITIALIZED = 3, OPERATING_SYSTEM = 304, UNKNOWN = 999 };

static const char *dir(void) { return getenv("FAKE_CUDA_DIR"); }

static int path(char *out, size_t n, const char *name, int pid) {
    if (!dir()) return -1;
    if (pid >= 0) snprintf(out, n, "%s/%s-%d", dir(), name, pid);
    else snprintf(out, n, "%s/%s", dir(), name);
    return 0;
}

static int failing(const char *call) {
    char p[4096], name[64];
    snprintf(name, sizeof name, "fail-%s", call);
    return path(p, sizeof p, name, -1) == 0 && access(p, F_OK) == 0;
}

/* The FAKE_CUDA_ID in process pid's environment, into `id`; 0 if it has one.
 * The environment is process memory: while a lazy restore still brings it in,
 * reading it from here can fail, so a pid seen before (id-PID in the
 * directory) keeps its id, and an unreadable environment is retried for a
 * while. */
static int cuda_id(int pid, char *id, size_t n) {
    char p[4096], env[65536];
    if (path(p, sizeof p, "id", pid) == 0) {
        FILE *f = fopen(p, "r");
        if (f) {
            int got = fscanf(f, "%127s", id) == 1;
            fclose(f);
            if (got) return 0;
        }
    }
    for (int attempt = 0; attempt < 200; attempt++) {
        snprintf(p, sizeof p, "/proc/%d/environ", pid);
        int fd = open(p, O_RDONLY);
        if (fd < 0) return -1;
        ssize_t len = read(fd, env, sizeof env - 1);
        close(fd);
        if (len <= 0) {
            usleep(10000);
            continue;
        }
        env[len] = 0;
        for (char *e = env; e < env + len; e += strlen(e) + 1) {
            if (!strncmp(e, "FAKE_CUDA_ID=", 13)) {
                snprintf(id, n, "%s", e + 13);
                if (path(p, sizeof p, "id", pid) == 0) {
                    FILE *f = fopen(p, "w");
                    if (f) {
                        fprintf(f, "%s\n", id);
                        fclose(f);
                    }
                }
                return 0;
            }
        }
        return -1;
    }
    return -1;
}

static int state_path(char *out, size_t n, int pid) {
    char id[128];
    if (!dir() || cuda_id(pid, id, sizeof id) != 0) return -1;
    snprintf(out, n, "%s/state-%s", dir(), id);
    return 0;
}

static int get_state(int pid) {
    char p[4096];
    int s = 0;
    if (state_path(p, sizeof p, pid) == 0) {
        FILE *f = fopen(p, "r");
        if (f) {
            if (fscanf(f, "%d", &s) != 1) s = 0;
            fclose(f);
        }
    }
    return s;
}

static void set_state(int pid, int s) {
    char p[4096];
    if (state_path(p, sizeof p, pid) == 0) {
        FILE *f = fopen(p, "w");
        if (f) {
            fprintf(f, "%d\n", s);
            fclose(f);
        }
    }
}

/* The target's state letter and tracer pid, "-" and -1 when it is gone. */
static void proc_status(int pid, char *state, int *tracer) {
    char p[64], line[256];
    *state = '-';
    *tracer = -1;
    snprintf(p, sizeof p, "/proc/%d/status", pid);
    FILE *f = fopen(p, "r");
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "State:", 6)) sscanf(line + 6, " %c", state);
        if (!strncmp(line, "TracerPid:", 10)) sscanf(line + 10, "%d", tracer);
    }
    fclose(f);
}

/* criuz's subcommand (its first argument), for the log. */
static void caller(char *out, size_t n) {
    char buf[512];
    snprintf(out, n, "?");
    int fd = open("/proc/self/cmdline", O_RDONLY);
    if (fd < 0) return;
    ssize_t len = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (len <= 0) return;
    buf[len] = 0;
    size_t first = strlen(buf) + 1;
    if ((ssize_t)first < len) snprintf(out, n, "%s", buf + first);
}

static void logf_(const char *call, int pid, const char *extra, CUresult r) {
    char p[4096], who[64], state;
    int tracer;
    if (path(p, sizeof p, "log", -1) != 0) return;
    proc_status(pid, &state, &tracer);
    caller(who, sizeof who);
    FILE *f = fopen(p, "a");
    if (!f) return;
    fprintf(f, "%s pid=%d caller=%s proc=%c tracer=%d result=%d%s%s\n", call, pid, who, state, tracer, r,
            extra ? " " : "", extra ? extra : "");
    fclose(f);
}

CUresult cuInit(unsigned int flags) {
    (void)flags;
    if (!dir()) return NOT_INITIALIZED;
    return failing("init") ? UNKNOWN : OK;
}

CUresult cuDriverGetVersion(int *v) {
    *v = 12080;
    return OK;
}

static int devices(char uuids[][33], char names[][128], int max) {
    char p[4096], line[256];
    int n = 0;
    if (path(p, sizeof p, "devices", -1) == 0) {
        FILE *f = fopen(p, "r");
        if (f) {
            while (n < max && fgets(line, sizeof line, f)) {
                if (sscanf(line, "%32s %127[^\n]", uuids[n], names[n]) == 2) n++;
            }
            fclose(f);
            return n;
        }
    }
    strcpy(uuids[0], "00112233445566778899aabbccddeeff");
    strcpy(names[0], "Fake GPU");
    return 1;
}

CUresult cuDeviceGetCount(int *n) {
    char u[8][33], m[8][128];
    *n = devices(u, m, 8);
    return OK;
}

CUresult cuDeviceGet(int *dev, int ordinal) {
    *dev = ordinal;
    return OK;
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, int dev) {
    char u[8][33], m[8][128];
    if (dev < 0 || dev >= devices(u, m, 8)) return 101;
    for (int i = 0; i < 16; i++) {
        unsigned int b;
        sscanf(u[dev] + 2 * i, "%2x", &b);
        uuid->bytes[i] = (unsigned char)b;
    }
    return OK;
}

CUresult cuDeviceGetName(char *name, int len, int dev) {
    char u[8][33], m[8][128];
    if (dev < 0 || dev >= devices(u, m, 8)) return 101;
    snprintf(name, (size_t)len, "%s", m[dev]);
    return OK;
}

CUresult cuGetErrorName(CUresult r, const char **s) {
    switch (r) {
    case OK: *s = "CUDA_SUCCESS"; return OK;
    case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return OK;
    case NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; return OK;
    case OPERATING_SYSTEM: *s = "CUDA_ERROR_OPERATING_SYSTEM"; return OK;
    case UNKNOWN: *s = "CUDA_ERROR_UNKNOWN"; return OK;
    default: *s = 0; return INVALID_VALUE;
    }
}

static int is_cuda(int pid) {
    char id[128];
    return cuda_id(pid, id, sizeof id) == 0;
}

CUresult cuCheckpointProcessGetState(int pid, int *state) {
    if (!is_cuda(pid)) return OPERATING_SYSTEM;
    if (failing("state")) return UNKNOWN;
    *state = get_state(pid);
    return OK;
}

/* One transition: from `from` to `to`, unless told to fail. */
static CUresult step(const char *call, int pid, int from, int to, const char *extra) {
    CUresult r = OK;
    char p[4096], name[64];
    snprintf(name, sizeof name, "slow-%s", call);
    if (path(p, sizeof p, name, -1) == 0) {
        FILE *f = fopen(p, "r");
        int secs = 0;
        if (f) {
            if (fscanf(f, "%d", &secs) != 1) secs = 0;
            fclose(f);
            sleep((unsigned)secs);
        }
    }
    if (!is_cuda(pid)) r = OPERATING_SYSTEM;
    else if (failing(call)) r = UNKNOWN;
    else if (get_state(pid) != from) r = INVALID_VALUE;
    /* Logged before the state changes: whoever sees the new state (a test
     * waiting for it) finds the call in the log too. */
    logf_(call, pid, extra, r);
    if (r == OK) set_state(pid, to);
    return r;
}

CUresult cuCheckpointProcessLock(int pid, LockArgs *args) {
    char extra[64];
    snprintf(extra, sizeof extra, "timeout=%u", args ? args->timeout_ms : 0);
    return step("lock", pid, 0, 1, extra);
}

CUresult cuCheckpointProcessCheckpoint(int pid, void *args) {
    (void)args;
    return step("checkpoint", pid, 1, 2, 0);
}

CUresult cuCheckpointProcessRestore(int pid, RestoreArgs *args) {
    char extra[1024] = "pairs=0";
    if (args && args->count) {
        int o = snprintf(extra, sizeof extra, "pairs=%u", args->count);
        for (unsigned int i = 0; i < args->count && o < 900; i++) {
            o += snprintf(extra + o, sizeof extra - o, " ");
            for (int b = 0; b < 16; b++) o += snprintf(extra + o, sizeof extra - o, "%02x", args->pairs[i].old_uuid.bytes[b]);
            o += snprintf(extra + o, sizeof extra - o, ">");
            for (int b = 0; b < 16; b++) o += snprintf(extra + o, sizeof extra - o, "%02x", args->pairs[i].new_uuid.bytes[b]);
        }
    }
    return step("restore", pid, 2, 1, extra);
}

CUresult cuCheckpointProcessUnlock(int pid, void *args) {
    (void)args;
    return step("unlock", pid, 1, 0, 0);
}
