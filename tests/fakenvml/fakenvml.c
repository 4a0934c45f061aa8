/*
 * fakenvml.c - a fake libnvidia-ml.so.1 so that the real pynvml module can be
 * tested against simulated GPUs on machines that have none.
 *
 * Why it is built this way:
 *
 *  - It is a real shared object with the real soname, loaded by pynvml's own
 *    CDLL("libnvidia-ml.so.1"), so tests go through the same ctypes calls,
 *    struct layouts and error codes as production instead of a Python mock
 *    that can drift from the library.
 *
 *  - Configuration is read at nvmlInit* time, not at load time, because a
 *    process can load a shared object only once: nvmlShutdown, change the
 *    FAKE_NVML_* environment, nvmlInit again and you have another machine.
 *      FAKE_NVML_CONFIG=<file>    machine description (wins over a profile)
 *      FAKE_NVML_PROFILE=<name>   built-in machine, default "dgx-a100"
 *      FAKE_NVML_CONTROL=<file>   optional run-time injection (see below)
 *    The built-in profiles are config text embedded below and go through the
 *    same parser as files, so there is one code path to trust.
 *
 *  - A broken config fails nvmlInit with NVML_ERROR_UNKNOWN and says why on
 *    stderr (and via fakeNvmlGetLastError()): a typo in a test must not turn
 *    silently into a different machine.
 *
 *  - Run-time faults (Xid, ECC, lost GPU, MIG toggles) come from lines that
 *    tests append to the control file.  It is re-read from the last offset on
 *    every call and every ~5 ms inside nvmlEventSetWait, which needs no
 *    helper thread or signal and keeps the library free of background work.
 *
 *  - Device handles point into static arrays, so a stale handle (kept across
 *    shutdown/init, or a MIG device that went away) is detected and answered
 *    with NVML_ERROR_INVALID_ARGUMENT instead of crashing the process.
 *
 *  - One mutex guards all state; it is never held while sleeping, because a
 *    health thread blocks in nvmlEventSetWait while others keep querying.
 *
 * The config format is described in README.md next to this file.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* NVML ABI subset (must match nvml.h / pynvml.py)                          */
/* ------------------------------------------------------------------------ */

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_TOPOLOGY_INTERNAL 0
#define NVML_TOPOLOGY_SINGLE 10
#define NVML_TOPOLOGY_HOSTBRIDGE 30
#define NVML_TOPOLOGY_NODE 40
#define NVML_TOPOLOGY_SYSTEM 50

#define NVML_P2P_CAPS_INDEX_NVLINK 2
#define NVML_P2P_CAPS_INDEX_UNKNOWN 5
#define NVML_P2P_STATUS_OK 0
#define NVML_P2P_STATUS_NOT_SUPPORTED 5

#define NVML_NVLINK_DEVICE_TYPE_GPU 0x00
#define NVML_NVLINK_DEVICE_TYPE_SWITCH 0x02

#define NVML_MEMORY_ERROR_TYPE_CORRECTED 0
#define NVML_MEMORY_ERROR_TYPE_UNCORRECTED 1
#define NVML_VOLATILE_ECC 0
#define NVML_AGGREGATE_ECC 1

#define EV_SINGLE_BIT_ECC 0x1ULL
#define EV_DOUBLE_BIT_ECC 0x2ULL
#define EV_PSTATE 0x4ULL
#define EV_XID 0x8ULL
#define EV_CLOCK 0x10ULL
#define EV_MIG_CONFIG 0x100ULL /* nvmlEventMigConfigChange */

#define NVML_MEMORY_V2_VERSION 0x02000028u
#define NVML_PCI_INFO_EXT_V1_VERSION 0x01000040u

#define NVML_NVLINK_MAX_LINKS 36
#define NVML_NO_INSTANCE 0xFFFFFFFFu

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int version;
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    unsigned int baseClass;
    unsigned int subClass;
    char busId[32];
} nvmlPciInfoExt_t;

typedef struct {
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

/* Opaque to callers; only the address matters (see resolve()). */
struct fake_device {
    unsigned int gpu;
    unsigned int slot;
};
typedef struct fake_device *nvmlDevice_t;

struct fake_event_set;
typedef struct fake_event_set *nvmlEventSet_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct { /* nvmlEventSetWait (v1) predates the instance ids */
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
} nvmlEventData_v1_t;

/* ------------------------------------------------------------------------ */
/* Configuration model                                                      */
/* ------------------------------------------------------------------------ */

#define MAX_GPUS 32
#define MAX_MIG 16
#define MAX_NAMES 32
#define NAME_LEN 96
#define FN_LEN 64

#define UNSET_U32 UINT_MAX
#define UNSET_U64 ULLONG_MAX

struct namelist {
    unsigned int n;
    char names[MAX_NAMES][FN_LEN];
};

struct pciaddr {
    unsigned int domain, bus, device, function;
};

struct linkset {
    unsigned int n;
    struct pciaddr remote[NVML_NVLINK_MAX_LINKS];
};

struct cc {
    int major, minor;
};

struct mig {
    int present;
    char name[NAME_LEN];
    char uuid[NAME_LEN];
    unsigned long long memory_total, memory_used;
    unsigned int gi, ci, slices, ci_slices;
    unsigned int sms, copy_engines, decoders, encoders, jpegs, ofas;
    unsigned int slot;
    /* nvmlGpuInstanceGetInfo: the GPU instance's profile id (as `nvidia-smi mig -lgip` lists it) and
     * placement in memory slices; defaults from A100_40GB_PROFILES and the first free placement. */
    unsigned int profile_id, placement_start, placement_size;
};

struct gpu {
    char name[NAME_LEN];
    char uuid[NAME_LEN];
    char serial[32];
    unsigned long long memory_total, memory_used, memory_reserved;
    struct pciaddr pci;
    unsigned int pci_set;
    unsigned int pci_device_id, pci_subsystem_id, pci_class;
    unsigned int minor;
    struct cc cc;
    unsigned int architecture, brand;
    int numa, pcie_switch, host_bridge;
    unsigned int persistence;
    unsigned int ecc_enabled;
    unsigned long long ecc_uncorrected, ecc_corrected;
    unsigned int retired_pages_pending;
    unsigned int remapped_corrected, remapped_uncorrected, remapped_pending, remapped_failure;
    unsigned int mig_capable, mig_mode, pending_mig_mode, max_mig;
    int handle_error;
    unsigned int lost;
    struct linkset links;
    unsigned int nvlink_links;
    unsigned long long supported_events;
    unsigned long long registrable_events; /* what RegisterEvents takes; default supported_events */
    struct namelist unsupported;
    /* nvmlDeviceGetGpuFabricInfo(V): NVSwitch fabric (Hopper and newer; older GPUs: NOT_SUPPORTED).
     * fabric_state unset: SUCCESS with state NOT_SUPPORTED, as a GPU outside any fabric answers. */
    unsigned int fabric_state, fabric_clique;
    char fabric_cluster_uuid[NAME_LEN];
    unsigned int nmig; /* [mig] sections seen, for sequential slots */
    struct mig migs[MAX_MIG];
};

struct config {
    char driver_version[80];
    char nvml_version[80];
    int cuda_version;
    int init_error;
    struct namelist unsupported, missing;
    unsigned int ngpus;
    struct gpu gpus[MAX_GPUS];
};

/* ------------------------------------------------------------------------ */
/* Built-in profiles: config text, parsed exactly like a config file        */
/* ------------------------------------------------------------------------ */

#define SYS_550 \
    "[system]\n" \
    "driver_version = 550.54.15\n" \
    "cuda_version = 12040\n" \
    "nvml_version = 12.550.54.15\n"

#define NVSWITCH_LINKS \
    "nvlink = 00000000:C4:00.0*2, 00000000:C5:00.0*2, 00000000:C6:00.0*2, " \
    "00000000:C7:00.0*2, 00000000:C8:00.0*2, 00000000:C9:00.0*2\n"

#define A100_80(bus, minor, numa, sw) \
    "[gpu]\n" \
    "name = NVIDIA A100-SXM4-80GB\n" \
    "memory_total = 81920 MiB\n" \
    "pci_bus_id = 00000000:" bus ":00.0\n" \
    "pci_device_id = 0x20B210DE\n" \
    "pci_subsystem_id = 0x147F10DE\n" \
    "minor = " minor "\n" \
    "cc = 8.0\n" \
    "architecture = 7\n" \
    "numa = " numa "\n" \
    "pcie_switch = " sw "\n" \
    "host_bridge = " numa "\n" \
    "persistence = 1\n" \
    "mig_capable = 1\n" \
    "max_mig_devices = 7\n" \
    NVSWITCH_LINKS

#define L4(bus, minor, numa, extra) \
    "[gpu]\n" \
    "name = NVIDIA L4\n" \
    "memory_total = 23034 MiB\n" \
    "pci_bus_id = 00000000:" bus ":00.0\n" \
    "pci_device_id = 0x27B810DE\n" \
    "pci_subsystem_id = 0x16CA10DE\n" \
    "minor = " minor "\n" \
    "cc = 8.9\n" \
    "architecture = 8\n" \
    "numa = " numa "\n" \
    "pcie_switch = " numa "\n" \
    "host_bridge = " numa "\n" \
    "persistence = 1\n" \
    extra

#define PCIE4_GPUS(extra2) \
    L4("17", "0", "0", "") \
    L4("18", "1", "0", "") \
    L4("CA", "2", "1", extra2) \
    L4("CB", "3", "1", "")

#define A6000(bus, minor, sw, peer) \
    "[gpu]\n" \
    "name = NVIDIA RTX A6000\n" \
    "brand = 13\n" \
    "memory_total = 49140 MiB\n" \
    "pci_bus_id = 00000000:" bus ":00.0\n" \
    "pci_device_id = 0x223010DE\n" \
    "pci_subsystem_id = 0x145910DE\n" \
    "pci_class = 0x0300\n" \
    "minor = " minor "\n" \
    "cc = 8.6\n" \
    "architecture = 7\n" \
    "numa = 0\n" \
    "pcie_switch = " sw "\n" \
    "host_bridge = 0\n" \
    "persistence = 1\n" \
    "nvlink = 00000000:" peer ":00.0*4\n"

#define A100_40(bus, minor, extra) \
    "[gpu]\n" \
    "name = NVIDIA A100-SXM4-40GB\n" \
    "memory_total = 40960 MiB\n" \
    "pci_bus_id = 00000000:" bus ":00.0\n" \
    "pci_device_id = 0x20B010DE\n" \
    "pci_subsystem_id = 0x134F10DE\n" \
    "minor = " minor "\n" \
    "cc = 8.0\n" \
    "architecture = 7\n" \
    "numa = 0\n" \
    "persistence = 1\n" \
    "mig_capable = 1\n" \
    "max_mig_devices = 7\n" \
    extra

#define MIG_A100_40(profile, mem, gi, slices) \
    "[mig]\n" \
    "name = NVIDIA A100-SXM4-40GB MIG " profile "\n" \
    "memory_total = " mem "\n" \
    "gpu_instance_id = " gi "\n" \
    "compute_instance_id = 0\n" \
    "slice_count = " slices "\n"

static const struct profile {
    const char *name;
    const char *text;
} PROFILES[] = {
    {"dgx-a100",
     SYS_550
     A100_80("07", "0", "0", "0")
     A100_80("0F", "1", "0", "0")
     A100_80("47", "2", "0", "1")
     A100_80("4E", "3", "0", "1")
     A100_80("87", "4", "1", "2")
     A100_80("90", "5", "1", "2")
     A100_80("B7", "6", "1", "3")
     A100_80("BD", "7", "1", "3")},
    {"pcie-4", SYS_550 PCIE4_GPUS("")},
    {"pairs-4",
     SYS_550
     A6000("1B", "0", "0", "1C")
     A6000("1C", "1", "0", "1B")
     A6000("3D", "2", "1", "3E")
     A6000("3E", "3", "1", "3D")},
    {"mig",
     SYS_550
     A100_40("07", "0",
             "mig_mode = 1\n"
             MIG_A100_40("1g.5gb", "4864 MiB", "7", "1")
             MIG_A100_40("1g.5gb", "4864 MiB", "8", "1")
             MIG_A100_40("2g.10gb", "9984 MiB", "3", "2"))
     A100_40("0F", "1", "mig_mode = 0\n")},
    {"h100",
     "[system]\n"
     "driver_version = 560.35.03\n"
     "cuda_version = 12060\n"
     "nvml_version = 12.560.35.03\n"
     "[gpu]\n"
     "name = NVIDIA H100 80GB HBM3\n"
     "memory_total = 81559 MiB\n"
     "pci_bus_id = 00000000:18:00.0\n"
     "pci_device_id = 0x233010DE\n"
     "pci_subsystem_id = 0x16C110DE\n"
     "minor = 0\n"
     "cc = 9.0\n"
     "architecture = 9\n"
     "numa = 0\n"
     "persistence = 1\n"
     "mig_capable = 1\n"
     "max_mig_devices = 7\n"},
    {"no-gpu", SYS_550},
    {"no-driver", "[system]\ninit_error = 9\n"},
    {"init-fail", "[system]\ninit_error = 18\n"},
    {"lost-gpu", SYS_550 PCIE4_GPUS("lost = 1\n")},
    {"old-driver",
     SYS_550
     "missing = nvmlDeviceGetNumaNodeId, nvmlDeviceGetRemappedRows, nvmlDeviceGetMigMode\n"
     "unsupported = nvmlDeviceGetPersistenceMode, nvmlDeviceGetNvLinkState\n"
     PCIE4_GPUS("")},
};

#define NPROFILES (sizeof PROFILES / sizeof PROFILES[0])
#define DEFAULT_PROFILE "dgx-a100"

/* ------------------------------------------------------------------------ */
/* Global state                                                             */
/* ------------------------------------------------------------------------ */

struct event {
    struct event *next;
    unsigned int gpu;
    unsigned long long type, data;
    unsigned int gi, ci;
    int lost; /* delivered as NVML_ERROR_GPU_IS_LOST */
};

struct fake_event_set {
    struct fake_event_set *next;
    unsigned long long mask[MAX_GPUS];
    struct event *head, *tail;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int g_refcount;
static struct config g_cfg;
static struct fake_event_set *g_sets;
static char g_last_error[1024];

static struct {
    char path[4096];
    off_t offset;
    dev_t dev;
    ino_t ino;
    int seen;
} g_ctl;

static struct fake_device g_gpu_handles[MAX_GPUS];
static struct fake_device g_mig_handles[MAX_GPUS][MAX_MIG];
/* GPU instance handles (nvmlGpuInstance_t): one per slot, the slot of the instance's first MIG device. */
static struct fake_device g_gi_handles[MAX_GPUS][MAX_MIG];

/* ------------------------------------------------------------------------ */
/* Small helpers                                                            */
/* ------------------------------------------------------------------------ */

static void set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void set_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
    fprintf(stderr, "fakenvml: %s\n", g_last_error);
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = '\0';
    return s;
}

static void strip_comment(char *s)
{
    char *hash = strchr(s, '#');
    if (hash)
        *hash = '\0';
}

/* Decimal or 0x-hex, optional KiB/MiB/GiB/TiB suffix. */
static int parse_u64(const char *v, unsigned long long *out)
{
    const char *p = v;
    while (isspace((unsigned char)*p))
        p++;
    if (*p == '-' || *p == '+' || *p == '\0')
        return -1;
    int base = (p[0] == '0' && (p[1] == 'x' || p[1] == 'X')) ? 16 : 10;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(p, &end, base);
    if (end == p || errno)
        return -1;
    while (isspace((unsigned char)*end))
        end++;
    unsigned long long mult = 1;
    if (*end) {
        if (!strcasecmp(end, "KiB"))
            mult = 1ULL << 10;
        else if (!strcasecmp(end, "MiB"))
            mult = 1ULL << 20;
        else if (!strcasecmp(end, "GiB"))
            mult = 1ULL << 30;
        else if (!strcasecmp(end, "TiB"))
            mult = 1ULL << 40;
        else
            return -1;
    }
    if (x > ULLONG_MAX / mult)
        return -1;
    *out = x * mult;
    return 0;
}

static int parse_u32(const char *v, unsigned int *out)
{
    unsigned long long x;
    if (parse_u64(v, &x) || x > UINT_MAX)
        return -1;
    *out = (unsigned int)x;
    return 0;
}

static int parse_int(const char *v, int *out)
{
    const char *p = v;
    while (isspace((unsigned char)*p))
        p++;
    int neg = 0;
    if (*p == '-') {
        neg = 1;
        p++;
    }
    unsigned long long x;
    if (parse_u64(p, &x) || x > (unsigned long long)INT_MAX)
        return -1;
    *out = neg ? -(int)x : (int)x;
    return 0;
}

static int parse_bool(const char *v, unsigned int *out)
{
    if (!strcmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes")) {
        *out = 1;
        return 0;
    }
    if (!strcmp(v, "0") || !strcasecmp(v, "false") || !strcasecmp(v, "no")) {
        *out = 0;
        return 0;
    }
    return -1;
}

/* "DDDDDDDD:BB:DD.F", "DDDD:BB:DD.F" or "BB:DD.F" (hex). */
static int parse_busid(const char *s, struct pciaddr *a)
{
    unsigned int d = 0, b, dv, f;
    int n = -1;
    const char *colon = strchr(s, ':');
    if (colon && strchr(colon + 1, ':')) {
        if (sscanf(s, "%x:%x:%x.%x%n", &d, &b, &dv, &f, &n) != 4)
            return -1;
    } else {
        if (sscanf(s, "%x:%x.%x%n", &b, &dv, &f, &n) != 3)
            return -1;
    }
    if (n < 0 || s[n] != '\0' || b > 0xff || dv > 0x1f || f > 7)
        return -1;
    a->domain = d;
    a->bus = b;
    a->device = dv;
    a->function = f;
    return 0;
}

static int pci_eq(const struct pciaddr *a, const struct pciaddr *b)
{
    return a->domain == b->domain && a->bus == b->bus && a->device == b->device &&
           a->function == b->function;
}

static void format_busid(const struct pciaddr *a, char *out, size_t n)
{
    snprintf(out, n, "%08X:%02X:%02X.%X", a->domain, a->bus, a->device, a->function);
}

static void format_busid_legacy(const struct pciaddr *a, char *out, size_t n)
{
    snprintf(out, n, "%04X:%02X:%02X.%X", a->domain & 0xffff, a->bus, a->device, a->function);
}

static int namelist_add(struct namelist *l, const char *value)
{
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", value);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        tok = trim(tok);
        if (!*tok)
            continue;
        if (l->n >= MAX_NAMES || strlen(tok) >= FN_LEN)
            return -1;
        snprintf(l->names[l->n++], FN_LEN, "%s", tok);
    }
    return 0;
}

/* Exact name, or the name without its _vN suffix ("nvmlDeviceGetCount"
 * also covers nvmlDeviceGetCount_v2). */
static int namelist_has(const struct namelist *l, const char *fn)
{
    size_t base = strlen(fn);
    const char *v = strrchr(fn, '_');
    if (v && v[1] == 'v' && isdigit((unsigned char)v[2]))
        base = (size_t)(v - fn);
    for (unsigned int i = 0; i < l->n; i++) {
        if (!strcmp(l->names[i], fn))
            return 1;
        if (strlen(l->names[i]) == base && !strncmp(l->names[i], fn, base))
            return 1;
    }
    return 0;
}

static unsigned long long mix64(unsigned long long x)
{
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static unsigned long long hash_str(const char *s, unsigned long long seed)
{
    unsigned long long h = 0xCBF29CE484222325ULL ^ seed;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001B3ULL;
    return mix64(h);
}

static void make_uuid(char *out, size_t n, const char *prefix, unsigned long long a,
                      unsigned long long b)
{
    snprintf(out, n, "%s-%08x-%04x-%04x-%04x-%012llx", prefix, (unsigned int)(a >> 32),
             (unsigned int)((a >> 16) & 0xffff), (unsigned int)(a & 0xffff),
             (unsigned int)((b >> 48) & 0xffff), b & 0xffffffffffffULL);
}

/* ------------------------------------------------------------------------ */
/* Config parser                                                            */
/* ------------------------------------------------------------------------ */

enum section { SEC_NONE, SEC_SYSTEM, SEC_GPU, SEC_MIG };
enum ktype { K_STR, K_U32, K_INT, K_U64, K_BOOL, K_BUSID, K_CC, K_LIST, K_NVLINK };

struct keydef {
    enum section sec;
    const char *key;
    enum ktype type;
    size_t off;
    size_t size;
};

#define KS(k, t, f) {SEC_SYSTEM, k, t, offsetof(struct config, f), sizeof(((struct config *)0)->f)}
#define KG(k, t, f) {SEC_GPU, k, t, offsetof(struct gpu, f), sizeof(((struct gpu *)0)->f)}
#define KM(k, t, f) {SEC_MIG, k, t, offsetof(struct mig, f), sizeof(((struct mig *)0)->f)}

static const struct keydef KEYS[] = {
    KS("driver_version", K_STR, driver_version),
    KS("cuda_version", K_INT, cuda_version),
    KS("nvml_version", K_STR, nvml_version),
    KS("init_error", K_INT, init_error),
    KS("unsupported", K_LIST, unsupported),
    KS("missing", K_LIST, missing),

    KG("name", K_STR, name),
    KG("uuid", K_STR, uuid),
    KG("serial", K_STR, serial),
    KG("memory_total", K_U64, memory_total),
    KG("memory_used", K_U64, memory_used),
    KG("memory_reserved", K_U64, memory_reserved),
    KG("pci_bus_id", K_BUSID, pci),
    KG("pci_device_id", K_U32, pci_device_id),
    KG("pci_subsystem_id", K_U32, pci_subsystem_id),
    KG("pci_class", K_U32, pci_class),
    KG("minor", K_U32, minor),
    KG("cc", K_CC, cc),
    KG("architecture", K_U32, architecture),
    KG("brand", K_U32, brand),
    KG("numa", K_INT, numa),
    KG("pcie_switch", K_INT, pcie_switch),
    KG("host_bridge", K_INT, host_bridge),
    KG("persistence", K_BOOL, persistence),
    KG("ecc_enabled", K_BOOL, ecc_enabled),
    KG("ecc_uncorrected", K_U64, ecc_uncorrected),
    KG("ecc_corrected", K_U64, ecc_corrected),
    KG("retired_pages_pending", K_BOOL, retired_pages_pending),
    KG("remapped_corrected", K_U32, remapped_corrected),
    KG("remapped_uncorrected", K_U32, remapped_uncorrected),
    KG("remapped_pending", K_BOOL, remapped_pending),
    KG("remapped_failure", K_BOOL, remapped_failure),
    KG("mig_capable", K_BOOL, mig_capable),
    KG("mig_mode", K_BOOL, mig_mode),
    KG("pending_mig_mode", K_BOOL, pending_mig_mode),
    KG("max_mig_devices", K_U32, max_mig),
    KG("handle_error", K_INT, handle_error),
    KG("lost", K_BOOL, lost),
    KG("nvlink", K_NVLINK, links),
    KG("nvlink_links", K_U32, nvlink_links),
    KG("supported_events", K_U64, supported_events),
    KG("registrable_events", K_U64, registrable_events),
    KG("unsupported", K_LIST, unsupported),
    KG("fabric_state", K_U32, fabric_state),
    KG("fabric_clique", K_U32, fabric_clique),
    KG("fabric_cluster_uuid", K_STR, fabric_cluster_uuid),

    KM("name", K_STR, name),
    KM("uuid", K_STR, uuid),
    KM("memory_total", K_U64, memory_total),
    KM("memory_used", K_U64, memory_used),
    KM("gpu_instance_id", K_U32, gi),
    KM("compute_instance_id", K_U32, ci),
    KM("slice_count", K_U32, slices),
    KM("ci_slice_count", K_U32, ci_slices),
    KM("multiprocessor_count", K_U32, sms),
    KM("copy_engines", K_U32, copy_engines),
    KM("decoders", K_U32, decoders),
    KM("encoders", K_U32, encoders),
    KM("jpegs", K_U32, jpegs),
    KM("ofas", K_U32, ofas),
    KM("slot", K_U32, slot),
    KM("profile_id", K_U32, profile_id),
    KM("placement_start", K_U32, placement_start),
    KM("placement_size", K_U32, placement_size),
};

#define NKEYS (sizeof KEYS / sizeof KEYS[0])

/* "<bus id>*<count>, ..." */
static int parse_nvlink(const char *value, struct linkset *ls, char *err, size_t errn)
{
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", value);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        tok = trim(tok);
        if (!*tok)
            continue;
        unsigned int count = 1;
        char *star = strchr(tok, '*');
        if (star) {
            *star = '\0';
            if (parse_u32(trim(star + 1), &count) || count == 0) {
                snprintf(err, errn, "bad link count in nvlink entry '%s'", tok);
                return -1;
            }
        }
        struct pciaddr a;
        if (parse_busid(trim(tok), &a)) {
            snprintf(err, errn, "bad PCI bus id '%s' in nvlink", trim(tok));
            return -1;
        }
        for (unsigned int i = 0; i < count; i++) {
            if (ls->n >= NVML_NVLINK_MAX_LINKS) {
                snprintf(err, errn, "more than %d NVLink links", NVML_NVLINK_MAX_LINKS);
                return -1;
            }
            ls->remote[ls->n++] = a;
        }
    }
    return 0;
}

static int set_value(void *base, const struct keydef *k, const char *value, char *err, size_t errn)
{
    char *field = (char *)base + k->off;
    switch (k->type) {
    case K_STR:
        if (strlen(value) >= k->size) {
            snprintf(err, errn, "value of %s is too long (max %zu)", k->key, k->size - 1);
            return -1;
        }
        memcpy(field, value, strlen(value) + 1);
        return 0;
    case K_U32:
        if (parse_u32(value, (unsigned int *)(void *)field))
            break;
        return 0;
    case K_INT:
        if (parse_int(value, (int *)(void *)field))
            break;
        return 0;
    case K_U64:
        if (parse_u64(value, (unsigned long long *)(void *)field))
            break;
        return 0;
    case K_BOOL:
        if (parse_bool(value, (unsigned int *)(void *)field))
            break;
        return 0;
    case K_BUSID: {
        struct gpu *g = base;
        if (parse_busid(value, &g->pci))
            break;
        g->pci_set = 1;
        return 0;
    }
    case K_CC: {
        struct cc *c = (struct cc *)(void *)field;
        char *end;
        errno = 0;
        long maj = strtol(value, &end, 10);
        if (end == value || *end != '.' || errno || maj < 0 || maj > 100)
            break;
        const char *p = end + 1;
        long min = strtol(p, &end, 10);
        if (end == p || *end || min < 0 || min > 100)
            break;
        c->major = (int)maj;
        c->minor = (int)min;
        return 0;
    }
    case K_LIST:
        if (namelist_add((struct namelist *)(void *)field, value)) {
            snprintf(err, errn, "too many or too long names in %s", k->key);
            return -1;
        }
        return 0;
    case K_NVLINK:
        return parse_nvlink(value, (struct linkset *)(void *)field, err, errn);
    }
    snprintf(err, errn, "bad value for %s: '%s'", k->key, value);
    return -1;
}

static void gpu_defaults(struct gpu *g)
{
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "NVIDIA A100-SXM4-80GB");
    g->memory_total = 81920ULL << 20;
    g->memory_used = UNSET_U64;
    g->pci_device_id = 0x20B210DE;
    g->pci_subsystem_id = 0x147F10DE;
    g->pci_class = 0x0302;
    g->minor = UNSET_U32;
    g->cc.major = 8;
    g->cc.minor = 0;
    g->architecture = 7;
    g->brand = 14; /* NVML_BRAND_NVIDIA */
    g->numa = 0;
    g->pcie_switch = -1;
    g->host_bridge = -1;
    g->persistence = 1;
    g->ecc_enabled = 1;
    g->pending_mig_mode = UNSET_U32;
    g->max_mig = 7;
    g->nvlink_links = UNSET_U32;
    g->supported_events = UNSET_U64; /* finalize(): the MIG event too on a MIG-capable GPU */
    g->registrable_events = UNSET_U64; /* finalize(): supported_events */
    g->fabric_state = UNSET_U32;
}

/* The real driver's GPU instance profiles of an A100 40GB, as `nvidia-smi mig -lgip` (id, slices,
 * memory) and `-lgipp` (placement size in memory slices) list them: the only table the fake has;
 * mig-create on other GPUs is refused (see README). */
static const struct mig_profile {
    const char *name;
    unsigned int slices;
    unsigned long long mib;
    unsigned int id;
    unsigned int placement_size;
} A100_40GB_PROFILES[] = {
    {"1g.5gb", 1, 4864, 19, 1},   {"2g.10gb", 2, 9984, 14, 2}, {"3g.20gb", 3, 19968, 9, 4},
    {"4g.20gb", 4, 19968, 5, 4},  {"7g.40gb", 7, 40192, 0, 8},
};

#define A100_COMPUTE_SLICES 7
#define A100_MEMORY_SLICES 8

static const struct mig_profile *profile_by_slices(unsigned int slices)
{
    for (size_t i = 0; i < sizeof A100_40GB_PROFILES / sizeof A100_40GB_PROFILES[0]; i++)
        if (A100_40GB_PROFILES[i].slices == slices)
            return &A100_40GB_PROFILES[i];
    return NULL;
}

/* Profile id, placement size and start of a MIG device not given them: another compute instance of
 * the same GPU instance shares its placement; a new GPU instance takes the first start the A100
 * allows (aligned to its size, within the 7 compute and 8 memory slices) that no other instance
 * overlaps, as `nvidia-smi mig -cgi` without a placement does. */
static void mig_placement(struct gpu *g, struct mig *m)
{
    const struct mig_profile *p = profile_by_slices(m->slices);
    if (m->profile_id == UNSET_U32)
        m->profile_id = p ? p->id : m->slices;
    if (m->placement_size == UNSET_U32)
        m->placement_size = p ? p->placement_size : m->slices;
    if (m->placement_start != UNSET_U32)
        return;
    for (unsigned int s = 0; s < MAX_MIG; s++) {
        const struct mig *o = &g->migs[s];
        if (o != m && o->present && o->gi == m->gi && o->placement_start != UNSET_U32) {
            m->placement_start = o->placement_start;
            return;
        }
    }
    unsigned int size = m->placement_size ? m->placement_size : 1;
    for (unsigned int start = 0; start + size <= A100_MEMORY_SLICES; start += size) {
        if (start + m->slices > A100_COMPUTE_SLICES)
            break;
        int clash = 0;
        for (unsigned int s = 0; s < MAX_MIG && !clash; s++) {
            const struct mig *o = &g->migs[s];
            if (o == m || !o->present || o->gi == m->gi || o->placement_start == UNSET_U32)
                continue;
            clash = start < o->placement_start + o->placement_size && o->placement_start < start + size;
        }
        if (!clash) {
            m->placement_start = start;
            return;
        }
    }
    m->placement_start = 0; /* a geometry the A100 would refuse: the config said so */
}

static void mig_defaults(struct mig *m)
{
    memset(m, 0, sizeof *m);
    m->memory_total = 4864ULL << 20;
    m->memory_used = UNSET_U64;
    m->slices = 1;
    m->ci_slices = UNSET_U32;
    m->sms = m->copy_engines = m->decoders = m->encoders = m->jpegs = m->ofas = UNSET_U32;
    m->slot = UNSET_U32;
    m->profile_id = m->placement_start = m->placement_size = UNSET_U32;
}

static int finalize(struct config *cfg, char *err, size_t errn)
{
    for (unsigned int i = 0; i < cfg->ngpus; i++) {
        struct gpu *g = &cfg->gpus[i];
        unsigned long long h = hash_str(g->name, i);
        if (!g->uuid[0])
            make_uuid(g->uuid, sizeof g->uuid, "GPU", h, mix64(h + 1));
        if (!g->serial[0])
            snprintf(g->serial, sizeof g->serial, "1%012llu", mix64(h + 2) % 1000000000000ULL);
        if (g->memory_used == UNSET_U64)
            g->memory_used = g->memory_total / 200;
        if (g->memory_used > g->memory_total || g->memory_reserved > g->memory_used) {
            snprintf(err, errn, "gpu %u: need memory_reserved <= memory_used <= memory_total", i);
            return -1;
        }
        if (!g->pci_set) {
            g->pci.bus = i + 1;
            g->pci_set = 1;
        }
        if (g->minor == UNSET_U32)
            g->minor = i;
        if (g->pending_mig_mode == UNSET_U32)
            g->pending_mig_mode = g->mig_mode;
        if (g->supported_events == UNSET_U64)
            g->supported_events = EV_SINGLE_BIT_ECC | EV_DOUBLE_BIT_ECC | EV_PSTATE | EV_XID | EV_CLOCK |
                                  (g->mig_capable ? EV_MIG_CONFIG : 0);
        if (g->registrable_events == UNSET_U64)
            g->registrable_events = g->supported_events;
        if (g->nvlink_links == UNSET_U32)
            g->nvlink_links = g->links.n;
        if (g->nvlink_links < g->links.n || g->nvlink_links > NVML_NVLINK_MAX_LINKS) {
            snprintf(err, errn, "gpu %u: nvlink_links must be between the number of active links and %d",
                     i, NVML_NVLINK_MAX_LINKS);
            return -1;
        }
        if (!g->mig_capable && (g->mig_mode || g->pending_mig_mode || g->nmig)) {
            snprintf(err, errn, "gpu %u: MIG mode or [mig] devices need mig_capable = 1", i);
            return -1;
        }
        if (g->mig_capable && (g->max_mig == 0 || g->max_mig > MAX_MIG)) {
            snprintf(err, errn, "gpu %u: max_mig_devices must be 1..%d", i, MAX_MIG);
            return -1;
        }
        for (unsigned int j = 0; j < i; j++) {
            if (pci_eq(&cfg->gpus[j].pci, &g->pci)) {
                snprintf(err, errn, "gpus %u and %u have the same pci_bus_id", j, i);
                return -1;
            }
            if (!strcmp(cfg->gpus[j].uuid, g->uuid)) {
                snprintf(err, errn, "gpus %u and %u have the same uuid", j, i);
                return -1;
            }
        }
        for (unsigned int s = 0; s < MAX_MIG; s++) {
            struct mig *m = &g->migs[s];
            if (!m->present)
                continue;
            if (s >= g->max_mig) {
                snprintf(err, errn, "gpu %u: MIG slot %u is not below max_mig_devices (%u)", i, s,
                         g->max_mig);
                return -1;
            }
            unsigned long long mh = mix64(h ^ (0x1000ULL + s));
            if (!m->uuid[0])
                make_uuid(m->uuid, sizeof m->uuid, "MIG", mh, mix64(mh + 1));
            if (!m->name[0])
                snprintf(m->name, sizeof m->name, "%s MIG %ug.%llugb", g->name, m->slices,
                         (m->memory_total + (512ULL << 20)) >> 30);
            if (m->memory_used == UNSET_U64)
                m->memory_used = m->memory_total / 200;
            if (m->memory_used > m->memory_total) {
                snprintf(err, errn, "gpu %u MIG slot %u: memory_used > memory_total", i, s);
                return -1;
            }
            if (m->ci_slices == UNSET_U32)
                m->ci_slices = m->slices;
            if (m->sms == UNSET_U32)
                m->sms = 14 * m->ci_slices;
            if (m->copy_engines == UNSET_U32)
                m->copy_engines = m->slices;
            if (m->decoders == UNSET_U32)
                m->decoders = m->slices / 2;
            if (m->encoders == UNSET_U32)
                m->encoders = 0;
            if (m->jpegs == UNSET_U32)
                m->jpegs = m->slices == 7 ? 1 : 0;
            if (m->ofas == UNSET_U32)
                m->ofas = m->slices == 7 ? 1 : 0;
            mig_placement(g, m);
        }
    }
    return 0;
}

static int commit_mig(struct gpu *g, const struct mig *m, char *err, size_t errn)
{
    unsigned int slot = m->slot;
    if (slot == UNSET_U32)
        for (slot = 0; slot < MAX_MIG && g->migs[slot].present; slot++)
            ;
    if (slot >= MAX_MIG || g->migs[slot].present) {
        snprintf(err, errn, "MIG slot %u is out of range or already used", slot);
        return -1;
    }
    g->migs[slot] = *m;
    g->migs[slot].present = 1;
    g->migs[slot].slot = slot;
    g->nmig++;
    return 0;
}

static int parse_config(const char *text, const char *src, struct config *cfg)
{
    char err[512] = "";
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->driver_version, sizeof cfg->driver_version, "550.54.15");
    snprintf(cfg->nvml_version, sizeof cfg->nvml_version, "12.550.54.15");
    cfg->cuda_version = 12040;

    enum section sec = SEC_NONE;
    struct gpu *g = NULL;
    struct mig m; /* a [mig] section is committed when it ends: its slot key may come last */
    unsigned int lineno = 0;
    const char *p = text;
    for (;;) {
        char line[4096];
        int at_end = *p == '\0';
        if (!at_end) {
            const char *nl = strchr(p, '\n');
            size_t len = nl ? (size_t)(nl - p) : strlen(p);
            lineno++;
            if (len >= sizeof line) {
                snprintf(err, sizeof err, "line too long");
                goto fail;
            }
            memcpy(line, p, len);
            line[len] = '\0';
            p = nl ? nl + 1 : p + len;
        } else {
            line[0] = '\0';
        }
        strip_comment(line);
        char *s = trim(line);
        if (sec == SEC_MIG && (at_end || *s == '[')) {
            if (commit_mig(g, &m, err, sizeof err))
                goto fail;
            sec = SEC_NONE;
        }
        if (at_end)
            break;
        if (!*s)
            continue;
        if (*s == '[') {
            char *close = strchr(s, ']');
            if (!close || trim(close + 1)[0]) {
                snprintf(err, sizeof err, "bad section header '%s'", s);
                goto fail;
            }
            *close = '\0';
            char *name = trim(s + 1);
            if (!strcmp(name, "system")) {
                sec = SEC_SYSTEM;
            } else if (!strcmp(name, "gpu")) {
                if (cfg->ngpus >= MAX_GPUS) {
                    snprintf(err, sizeof err, "more than %d [gpu] sections", MAX_GPUS);
                    goto fail;
                }
                g = &cfg->gpus[cfg->ngpus++];
                gpu_defaults(g);
                sec = SEC_GPU;
            } else if (!strcmp(name, "mig")) {
                if (!g) {
                    snprintf(err, sizeof err, "[mig] before any [gpu]");
                    goto fail;
                }
                mig_defaults(&m);
                sec = SEC_MIG;
            } else {
                snprintf(err, sizeof err, "unknown section [%s]", name);
                goto fail;
            }
            continue;
        }
        char *eq = strchr(s, '=');
        if (!eq) {
            snprintf(err, sizeof err, "expected 'key = value', got '%s'", s);
            goto fail;
        }
        *eq = '\0';
        char *key = trim(s);
        char *value = trim(eq + 1);
        if (sec == SEC_NONE) {
            snprintf(err, sizeof err, "key '%s' outside of a section", key);
            goto fail;
        }
        const struct keydef *k = NULL;
        for (size_t i = 0; i < NKEYS && !k; i++)
            if (KEYS[i].sec == sec && !strcmp(KEYS[i].key, key))
                k = &KEYS[i];
        if (!k) {
            snprintf(err, sizeof err, "unknown key '%s' in [%s]", key,
                     sec == SEC_SYSTEM ? "system" : sec == SEC_GPU ? "gpu" : "mig");
            goto fail;
        }
        void *base = sec == SEC_SYSTEM ? (void *)cfg : sec == SEC_GPU ? (void *)g : (void *)&m;
        if (set_value(base, k, value, err, sizeof err))
            goto fail;
    }
    if (finalize(cfg, err, sizeof err)) {
        set_error("%s: %s", src, err);
        return -1;
    }
    return 0;
fail:
    set_error("%s:%u: %s", src, lineno, err);
    return -1;
}

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 8192, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t n = fread(buf + len, 1, cap - len - 1, f);
        len += n;
        if (n == 0)
            break;
        if (cap - len - 1 == 0) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    int bad = ferror(f);
    fclose(f);
    if (!buf || bad) {
        free(buf);
        return NULL;
    }
    buf[len] = '\0';
    return buf;
}

static int load_config(struct config *cfg)
{
    const char *path = getenv("FAKE_NVML_CONFIG");
    if (path && *path) {
        char *text = read_file(path);
        if (!text) {
            set_error("cannot read FAKE_NVML_CONFIG=%s: %s", path, strerror(errno));
            return -1;
        }
        int rc = parse_config(text, path, cfg);
        free(text);
        return rc;
    }
    const char *name = getenv("FAKE_NVML_PROFILE");
    if (!name || !*name)
        name = DEFAULT_PROFILE;
    for (size_t i = 0; i < NPROFILES; i++) {
        if (!strcmp(PROFILES[i].name, name)) {
            char src[128];
            snprintf(src, sizeof src, "profile %s", name);
            return parse_config(PROFILES[i].text, src, cfg);
        }
    }
    char names[512] = "";
    for (size_t i = 0; i < NPROFILES; i++) {
        strncat(names, i ? ", " : "", sizeof names - strlen(names) - 1);
        strncat(names, PROFILES[i].name, sizeof names - strlen(names) - 1);
    }
    set_error("unknown FAKE_NVML_PROFILE '%s' (known: %s)", name, names);
    return -1;
}

/* ------------------------------------------------------------------------ */
/* Events and the control file (called with g_lock held)                    */
/* ------------------------------------------------------------------------ */

static void enqueue(struct fake_event_set *set, const struct event *tmpl)
{
    struct event *e = malloc(sizeof *e);
    if (!e)
        return;
    *e = *tmpl;
    e->next = NULL;
    if (set->tail)
        set->tail->next = e;
    else
        set->head = e;
    set->tail = e;
}

static void deliver(const struct event *ev)
{
    for (struct fake_event_set *s = g_sets; s; s = s->next) {
        unsigned long long mask = s->mask[ev->gpu];
        if (ev->lost ? mask != 0 : (mask & ev->type) != 0)
            enqueue(s, ev);
    }
}

static void free_set(struct fake_event_set *s)
{
    struct event *e = s->head;
    while (e) {
        struct event *n = e->next;
        free(e);
        e = n;
    }
    free(s);
}

/* "<gpu>" or "<gpu>:<gi>:<ci>" */
static int parse_target(const char *s, unsigned int *gpu, unsigned int *gi, unsigned int *ci)
{
    char buf[64];
    snprintf(buf, sizeof buf, "%s", s);
    char *c1 = strchr(buf, ':');
    *gi = *ci = NVML_NO_INSTANCE;
    if (c1) {
        *c1 = '\0';
        char *c2 = strchr(c1 + 1, ':');
        if (!c2)
            return -1;
        *c2 = '\0';
        if (parse_u32(c1 + 1, gi) || parse_u32(c2 + 1, ci))
            return -1;
    }
    if (parse_u32(buf, gpu) || *gpu >= g_cfg.ngpus)
        return -1;
    return 0;
}

/* MIG geometry changed at run time (mig-create / mig-destroy): see A100_40GB_PROFILES above. */
static unsigned long long g_mig_serial; /* every created instance gets a new UUID */

static const char *nvml_name(nvmlReturn_t rc)
{
    switch (rc) {
    case NVML_ERROR_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case NVML_ERROR_NOT_SUPPORTED: return "NOT_SUPPORTED";
    case NVML_ERROR_NOT_FOUND: return "NOT_FOUND";
    case NVML_ERROR_GPU_IS_LOST: return "GPU_IS_LOST";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "INSUFFICIENT_RESOURCES";
    default: return "UNKNOWN";
    }
}

/* A refused change: nothing changes and no event is sent; the reason is
 * what fakeNvmlGetLastError() says (and stderr), with the NVML code the real
 * create/destroy call would have returned. */
static void mig_refused(const char *line, nvmlReturn_t rc, const char *why)
{
    set_error("%s: refused (%s, as NVML would return %d %s): %s", g_ctl.path, line, rc, nvml_name(rc), why);
}

/* The checks nvmlDeviceCreateGpuInstance / nvmlGpuInstanceDestroy make on the parent. */
static nvmlReturn_t mig_parent_ok(const struct gpu *g, const char **why)
{
    if (g->lost) {
        *why = "the GPU is lost";
        return NVML_ERROR_GPU_IS_LOST;
    }
    if (!g->mig_capable) {
        *why = "the GPU is not MIG capable";
        return NVML_ERROR_NOT_SUPPORTED;
    }
    if (!g->mig_mode) {
        *why = "MIG mode is off on the GPU";
        return NVML_ERROR_NOT_SUPPORTED;
    }
    return NVML_SUCCESS;
}

#define REFUSE(rc_, why_) \
    do { \
        mig_refused(line, (rc_), (why_)); \
        return; \
    } while (0)

static void mig_changed(unsigned int gpu)
{
    /* The driver says only that the geometry changed, not what: no instance ids. */
    struct event ev;
    memset(&ev, 0, sizeof ev);
    ev.gpu = gpu;
    ev.type = EV_MIG_CONFIG;
    ev.gi = ev.ci = NVML_NO_INSTANCE;
    deliver(&ev);
}

/* mig-create <gpu> <profile> <gi> [ci]: a GPU instance and its one (full-size) compute instance,
 * like `nvidia-smi mig -cgi <profile> -C`; the test picks the ids NVML would pick. */
static void mig_create(const char *line, unsigned int gpu, const char *profile, unsigned int gi, unsigned int ci)
{
    struct gpu *g = &g_cfg.gpus[gpu];
    const char *why = NULL;
    nvmlReturn_t rc = mig_parent_ok(g, &why);
    if (rc != NVML_SUCCESS)
        REFUSE(rc, why);
    if (!strstr(g->name, "A100") || g->memory_total > (48ULL << 30))
        REFUSE(NVML_ERROR_NOT_SUPPORTED, "the fake knows MIG profiles of an A100 40GB only");
    const struct mig_profile *p = NULL;
    for (size_t i = 0; i < sizeof A100_40GB_PROFILES / sizeof A100_40GB_PROFILES[0]; i++)
        if (!strcmp(A100_40GB_PROFILES[i].name, profile))
            p = &A100_40GB_PROFILES[i];
    if (!p)
        REFUSE(NVML_ERROR_INVALID_ARGUMENT, "no such GPU instance profile");
    unsigned int used = 0, free_slot = UINT_MAX;
    for (unsigned int s = 0; s < g->max_mig; s++) {
        const struct mig *m = &g->migs[s];
        if (!m->present) {
            if (free_slot == UINT_MAX)
                free_slot = s;
            continue;
        }
        if (m->gi == gi)
            REFUSE(NVML_ERROR_INSUFFICIENT_RESOURCES,
                   "that GPU instance exists (and its compute instance takes all of it)");
        int seen = 0; /* a GPU instance's slices count once, however many compute instances it has */
        for (unsigned int t = 0; t < s && !seen; t++)
            seen = g->migs[t].present && g->migs[t].gi == m->gi;
        if (!seen)
            used += m->slices;
    }
    if (used + p->slices > A100_COMPUTE_SLICES)
        REFUSE(NVML_ERROR_INSUFFICIENT_RESOURCES, "not enough free slices on the GPU");
    if (free_slot == UINT_MAX)
        REFUSE(NVML_ERROR_INSUFFICIENT_RESOURCES, "max_mig_devices instances exist");
    struct mig *m = &g->migs[free_slot];
    mig_defaults(m);
    m->present = 1;
    m->slot = free_slot;
    char parent[NAME_LEN]; /* the GPU's name, copied: it lives in g_cfg too */
    memcpy(parent, g->name, sizeof parent);
    snprintf(m->name, sizeof m->name, "%.80s MIG %s", parent, p->name);
    unsigned long long h = mix64(hash_str(g->uuid, ++g_mig_serial) ^ 0x4D4947ULL);
    make_uuid(m->uuid, sizeof m->uuid, "MIG", h, mix64(h + 1));
    m->memory_total = p->mib << 20;
    m->memory_used = m->memory_total / 200;
    m->gi = gi;
    m->ci = ci;
    m->slices = m->ci_slices = p->slices;
    m->sms = 14 * p->slices;
    m->copy_engines = p->slices;
    m->decoders = p->slices / 2;
    m->encoders = 0;
    m->jpegs = m->ofas = p->slices == 7 ? 1 : 0;
    m->profile_id = p->id;
    m->placement_size = p->placement_size;
    mig_placement(g, m);
    mig_changed(gpu);
}

/* mig-destroy <gpu> <gi> [ci]: one compute instance, or the GPU instance with all of them
 * (`nvidia-smi mig -dci -gi <gi>` then `-dgi -gi <gi>`). */
static void mig_destroy(const char *line, unsigned int gpu, unsigned int gi, unsigned int ci)
{
    struct gpu *g = &g_cfg.gpus[gpu];
    const char *why = NULL;
    nvmlReturn_t rc = mig_parent_ok(g, &why);
    if (rc != NVML_SUCCESS)
        REFUSE(rc, why);
    unsigned int gone = 0;
    for (unsigned int s = 0; s < MAX_MIG; s++) {
        struct mig *m = &g->migs[s];
        if (m->present && m->gi == gi && (ci == UINT_MAX || m->ci == ci)) {
            memset(m, 0, sizeof *m);
            gone++;
        }
    }
    if (!gone)
        REFUSE(NVML_ERROR_NOT_FOUND, "no such GPU or compute instance");
    mig_changed(gpu);
}

static void control_line(char *line)
{
    strip_comment(line);
    char *s = trim(line);
    if (!*s)
        return;
    char copy[512];
    snprintf(copy, sizeof copy, "%s", s);
    char *save = NULL;
    char *cmd = strtok_r(s, " \t", &save);
    char *a1 = strtok_r(NULL, " \t", &save);
    char *a2 = strtok_r(NULL, " \t", &save);
    char *a3 = strtok_r(NULL, " \t", &save);
    char *a4 = strtok_r(NULL, " \t", &save);
    char *a5 = strtok_r(NULL, " \t", &save);
    unsigned int gpu, gi, ci, v, id_gi, id_ci = 0;
    struct event ev;
    memset(&ev, 0, sizeof ev);

    if (!strcmp(cmd, "xid") && a1 && a2 && !a3 && !parse_target(a1, &gpu, &gi, &ci) &&
        !parse_u32(a2, &v)) {
        ev.gpu = gpu;
        ev.type = EV_XID;
        ev.data = v;
        ev.gi = gi;
        ev.ci = ci;
        deliver(&ev);
        return;
    }
    if (!strcmp(cmd, "ecc") && a1 && !a2 && !parse_target(a1, &gpu, &gi, &ci)) {
        g_cfg.gpus[gpu].ecc_uncorrected++;
        ev.gpu = gpu;
        ev.type = EV_DOUBLE_BIT_ECC;
        ev.gi = gi;
        ev.ci = ci;
        deliver(&ev);
        return;
    }
    if (!strcmp(cmd, "lost") && a1 && !a2 && !parse_target(a1, &gpu, &gi, &ci)) {
        if (!g_cfg.gpus[gpu].lost) {
            g_cfg.gpus[gpu].lost = 1;
            ev.gpu = gpu;
            ev.lost = 1;
            ev.gi = ev.ci = NVML_NO_INSTANCE;
            deliver(&ev);
        }
        return;
    }
    if (!strcmp(cmd, "recover") && a1 && !a2 && !parse_target(a1, &gpu, &gi, &ci)) {
        g_cfg.gpus[gpu].lost = 0;
        return;
    }
    if (!strcmp(cmd, "mig") && a1 && a2 && !a3 && !parse_target(a1, &gpu, &gi, &ci) &&
        !parse_bool(a2, &v) && g_cfg.gpus[gpu].mig_capable) {
        g_cfg.gpus[gpu].mig_mode = v;
        g_cfg.gpus[gpu].pending_mig_mode = v;
        return;
    }
    if (!strcmp(cmd, "mig-create") && a1 && a2 && a3 && !a5 && !parse_target(a1, &gpu, &gi, &ci) &&
        gi == NVML_NO_INSTANCE && !parse_u32(a3, &id_gi) && (!a4 || !parse_u32(a4, &id_ci))) {
        mig_create(copy, gpu, a2, id_gi, id_ci);
        return;
    }
    if (!strcmp(cmd, "mig-destroy") && a1 && a2 && !a4 && !parse_target(a1, &gpu, &gi, &ci) &&
        gi == NVML_NO_INSTANCE && !parse_u32(a2, &id_gi) && (!a3 || !parse_u32(a3, &id_ci))) {
        mig_destroy(copy, gpu, id_gi, a3 ? id_ci : UINT_MAX);
        return;
    }
    fprintf(stderr, "fakenvml: %s: ignoring bad control line: %s\n", g_ctl.path, copy);
}

static void control_poll(void)
{
    if (!g_ctl.path[0])
        return;
    struct stat st;
    if (stat(g_ctl.path, &st) != 0)
        return; /* not created yet */
    if (!g_ctl.seen || st.st_dev != g_ctl.dev || st.st_ino != g_ctl.ino || st.st_size < g_ctl.offset) {
        /* first sight, replaced or truncated: start over */
        g_ctl.seen = 1;
        g_ctl.dev = st.st_dev;
        g_ctl.ino = st.st_ino;
        g_ctl.offset = 0;
    }
    if (st.st_size == g_ctl.offset)
        return;
    int fd = open(g_ctl.path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    size_t want = (size_t)(st.st_size - g_ctl.offset);
    char *buf = malloc(want + 1);
    ssize_t got = buf ? pread(fd, buf, want, g_ctl.offset) : -1;
    close(fd);
    if (got <= 0) {
        free(buf);
        return;
    }
    buf[got] = '\0';
    char *start = buf;
    char *nl;
    /* Only complete lines; a half-written last line waits for the next poll. */
    while ((nl = memchr(start, '\n', (size_t)(buf + got - start))) != NULL) {
        *nl = '\0';
        g_ctl.offset += (off_t)(nl - start + 1);
        control_line(start);
        start = nl + 1;
    }
    free(buf);
}

/* ------------------------------------------------------------------------ */
/* Entry/exit helpers                                                       */
/* ------------------------------------------------------------------------ */

struct dev {
    unsigned int gpu;
    int is_mig;
    unsigned int slot;
    struct gpu *g;
    struct mig *m;
    nvmlDevice_t parent;
};

#define ALLOW_MIG 1

static int resolve(const void *h, struct dev *d)
{
    uintptr_t p = (uintptr_t)h;
    uintptr_t base = (uintptr_t)g_gpu_handles;
    size_t sz = sizeof(struct fake_device);
    if (p >= base && p < base + sizeof g_gpu_handles && (p - base) % sz == 0) {
        unsigned int i = (unsigned int)((p - base) / sz);
        if (i >= g_cfg.ngpus)
            return 0;
        d->gpu = i;
        d->is_mig = 0;
        d->slot = 0;
        d->g = &g_cfg.gpus[i];
        d->m = NULL;
        d->parent = &g_gpu_handles[i];
        return 1;
    }
    base = (uintptr_t)g_mig_handles;
    if (p >= base && p < base + sizeof g_mig_handles && (p - base) % sz == 0) {
        unsigned int i = (unsigned int)((p - base) / sz);
        unsigned int gpu = i / MAX_MIG, slot = i % MAX_MIG;
        if (gpu >= g_cfg.ngpus)
            return 0;
        struct gpu *g = &g_cfg.gpus[gpu];
        if (!g->mig_mode || !g->migs[slot].present)
            return 0;
        d->gpu = gpu;
        d->is_mig = 1;
        d->slot = slot;
        d->g = g;
        d->m = &g->migs[slot];
        d->parent = &g_gpu_handles[gpu];
        return 1;
    }
    return 0;
}

/* Takes g_lock; the caller must release it via END whatever this returns. */
static nvmlReturn_t begin(const char *fn)
{
    pthread_mutex_lock(&g_lock);
    if (!g_refcount)
        return NVML_ERROR_UNINITIALIZED;
    control_poll();
    if (namelist_has(&g_cfg.missing, fn))
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    return NVML_SUCCESS;
}

static nvmlReturn_t begin_sys(const char *fn, int args_ok)
{
    nvmlReturn_t rc = begin(fn);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!args_ok)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (namelist_has(&g_cfg.unsupported, fn))
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

static nvmlReturn_t begin_dev(const char *fn, nvmlDevice_t h, int args_ok, int flags, struct dev *d)
{
    nvmlReturn_t rc = begin(fn);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!resolve(h, d) || !args_ok)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (d->g->lost)
        return NVML_ERROR_GPU_IS_LOST;
    if (namelist_has(&g_cfg.unsupported, fn) || namelist_has(&d->g->unsupported, fn))
        return NVML_ERROR_NOT_SUPPORTED;
    if (d->is_mig && !(flags & ALLOW_MIG))
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

#define END(rc_) \
    do { \
        nvmlReturn_t r_ = (rc_); \
        pthread_mutex_unlock(&g_lock); \
        return r_; \
    } while (0)

#define SYS_ENTER(ok) \
    do { \
        nvmlReturn_t r0_ = begin_sys(__func__, (ok)); \
        if (r0_ != NVML_SUCCESS) \
            END(r0_); \
    } while (0)

#define DEV_ENTER(h, ok, flags) \
    struct dev d; \
    do { \
        nvmlReturn_t r0_ = begin_dev(__func__, (h), (ok), (flags), &d); \
        if (r0_ != NVML_SUCCESS) \
            END(r0_); \
    } while (0)

static nvmlReturn_t copy_str(char *dst, unsigned int len, const char *src)
{
    size_t n = strlen(src);
    if ((size_t)len < n + 1)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

static nvmlReturn_t handle_of(unsigned int i, nvmlDevice_t *out)
{
    struct gpu *g = &g_cfg.gpus[i];
    if (g->handle_error)
        return g->handle_error;
    if (g->lost)
        return NVML_ERROR_GPU_IS_LOST;
    *out = &g_gpu_handles[i];
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------ */
/* Init, shutdown, errors                                                   */
/* ------------------------------------------------------------------------ */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags; /* NO_GPUS / NO_ATTACH change nothing here */
    pthread_mutex_lock(&g_lock);
    if (g_refcount) {
        g_refcount++;
        END(NVML_SUCCESS);
    }
    struct config *cfg = calloc(1, sizeof *cfg);
    if (!cfg)
        END(NVML_ERROR_UNKNOWN);
    g_last_error[0] = '\0';
    if (load_config(cfg)) {
        free(cfg);
        END(NVML_ERROR_UNKNOWN);
    }
    if (cfg->init_error) {
        nvmlReturn_t rc = cfg->init_error;
        free(cfg);
        END(rc);
    }
    memcpy(&g_cfg, cfg, sizeof g_cfg);
    free(cfg);
    for (unsigned int i = 0; i < MAX_GPUS; i++) {
        g_gpu_handles[i].gpu = i;
        g_gpu_handles[i].slot = UINT_MAX;
        for (unsigned int s = 0; s < MAX_MIG; s++) {
            g_mig_handles[i][s].gpu = i;
            g_mig_handles[i][s].slot = s;
        }
    }
    memset(&g_ctl, 0, sizeof g_ctl);
    const char *ctl = getenv("FAKE_NVML_CONTROL");
    if (ctl && *ctl)
        snprintf(g_ctl.path, sizeof g_ctl.path, "%s", ctl);
    g_refcount = 1;
    control_poll(); /* lines written before init set the starting state */
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&g_lock);
    if (!g_refcount)
        END(NVML_ERROR_UNINITIALIZED);
    if (--g_refcount == 0) {
        while (g_sets) {
            struct fake_event_set *n = g_sets->next;
            free_set(g_sets);
            g_sets = n;
        }
        memset(&g_cfg, 0, sizeof g_cfg);
        memset(&g_ctl, 0, sizeof g_ctl);
    }
    END(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt request issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 22: return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case 23: return "Insufficient resources for request";
    case 24: return "Frequency not supported";
    case 25: return "Argument version mismatch";
    case 26: return "Deprecated";
    case 27: return "Not ready";
    case 28: return "GPU not found";
    case 29: return "Invalid state";
    case 30: return "Reset type not supported";
    case 999: return "Unknown Error";
    default: return "Unknown Error";
    }
}

/* Not part of NVML: why the last nvmlInit failed on a bad config. */
const char *fakeNvmlGetLastError(void)
{
    return g_last_error;
}

/* ------------------------------------------------------------------------ */
/* System queries                                                           */
/* ------------------------------------------------------------------------ */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    SYS_ENTER(version != NULL);
    END(copy_str(version, length, g_cfg.driver_version));
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    SYS_ENTER(version != NULL);
    END(copy_str(version, length, g_cfg.nvml_version));
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    SYS_ENTER(cudaDriverVersion != NULL);
    *cudaDriverVersion = g_cfg.cuda_version;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    SYS_ENTER(cudaDriverVersion != NULL);
    *cudaDriverVersion = g_cfg.cuda_version;
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* Enumeration                                                              */
/* ------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    SYS_ENTER(deviceCount != NULL);
    *deviceCount = g_cfg.ngpus;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    SYS_ENTER(deviceCount != NULL);
    *deviceCount = g_cfg.ngpus;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    SYS_ENTER(device != NULL);
    if (index >= g_cfg.ngpus)
        END(NVML_ERROR_INVALID_ARGUMENT);
    END(handle_of(index, device));
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    SYS_ENTER(device != NULL);
    if (index >= g_cfg.ngpus)
        END(NVML_ERROR_INVALID_ARGUMENT);
    END(handle_of(index, device));
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    SYS_ENTER(uuid != NULL && device != NULL);
    for (unsigned int i = 0; i < g_cfg.ngpus; i++) {
        struct gpu *g = &g_cfg.gpus[i];
        if (!strcmp(g->uuid, uuid))
            END(handle_of(i, device));
        if (!g->mig_mode)
            continue;
        for (unsigned int s = 0; s < MAX_MIG; s++) {
            if (g->migs[s].present && !strcmp(g->migs[s].uuid, uuid)) {
                if (g->lost)
                    END(NVML_ERROR_GPU_IS_LOST);
                *device = &g_mig_handles[i][s];
                END(NVML_SUCCESS);
            }
        }
    }
    END(NVML_ERROR_NOT_FOUND);
}

static nvmlReturn_t by_pci(const char *busId, nvmlDevice_t *device)
{
    struct pciaddr a;
    if (parse_busid(busId, &a))
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < g_cfg.ngpus; i++)
        if (pci_eq(&g_cfg.gpus[i].pci, &a))
            return handle_of(i, device);
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    SYS_ENTER(pciBusId != NULL && device != NULL);
    END(by_pci(pciBusId, device));
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    SYS_ENTER(pciBusId != NULL && device != NULL);
    END(by_pci(pciBusId, device));
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    DEV_ENTER(device, index != NULL, ALLOW_MIG);
    /* For MIG handles NVML returns the index usable with
     * nvmlDeviceGetMigDeviceHandleByIndex on the parent. */
    *index = d.is_mig ? d.slot : d.gpu;
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* Identity                                                                 */
/* ------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    DEV_ENTER(device, name != NULL, ALLOW_MIG);
    END(copy_str(name, length, d.m ? d.m->name : d.g->name));
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    DEV_ENTER(device, uuid != NULL, ALLOW_MIG);
    END(copy_str(uuid, length, d.m ? d.m->uuid : d.g->uuid));
}

nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length)
{
    DEV_ENTER(device, serial != NULL, 0);
    END(copy_str(serial, length, d.g->serial));
}

nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, unsigned int *type)
{
    DEV_ENTER(device, type != NULL, ALLOW_MIG);
    *type = d.g->brand;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    DEV_ENTER(device, minorNumber != NULL, 0);
    *minorNumber = d.g->minor;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    DEV_ENTER(device, major != NULL && minor != NULL, ALLOW_MIG);
    *major = d.g->cc.major;
    *minor = d.g->cc.minor;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch)
{
    DEV_ENTER(device, arch != NULL, ALLOW_MIG);
    *arch = d.g->architecture;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, int *node)
{
    DEV_ENTER(device, node != NULL, 0);
    if (d.g->numa < 0)
        END(NVML_ERROR_NOT_SUPPORTED);
    *node = d.g->numa;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, unsigned int *mode)
{
    DEV_ENTER(device, mode != NULL, 0);
    *mode = d.g->persistence;
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* Memory and PCI                                                           */
/* ------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    DEV_ENTER(device, memory != NULL, ALLOW_MIG);
    unsigned long long total = d.m ? d.m->memory_total : d.g->memory_total;
    unsigned long long used = d.m ? d.m->memory_used : d.g->memory_used;
    memory->total = total;
    memory->used = used; /* v1 counts the driver's reservation as used */
    memory->free = total - used;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    DEV_ENTER(device, memory != NULL, ALLOW_MIG);
    if (memory->version != NVML_MEMORY_V2_VERSION)
        END(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    unsigned long long total = d.m ? d.m->memory_total : d.g->memory_total;
    unsigned long long used = d.m ? d.m->memory_used : d.g->memory_used;
    unsigned long long reserved = d.m ? 0 : d.g->memory_reserved;
    memory->total = total;
    memory->reserved = reserved;
    memory->used = used - reserved;
    memory->free = total - used;
    END(NVML_SUCCESS);
}

static void fill_pci(nvmlPciInfo_t *pci, const struct pciaddr *a, unsigned int devid, unsigned int subsys)
{
    memset(pci, 0, sizeof *pci);
    format_busid_legacy(a, pci->busIdLegacy, sizeof pci->busIdLegacy);
    format_busid(a, pci->busId, sizeof pci->busId);
    pci->domain = a->domain;
    pci->bus = a->bus;
    pci->device = a->device;
    pci->pciDeviceId = devid;
    pci->pciSubSystemId = subsys;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    DEV_ENTER(device, pci != NULL, 0);
    fill_pci(pci, &d.g->pci, d.g->pci_device_id, d.g->pci_subsystem_id);
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_t *pci)
{
    DEV_ENTER(device, pci != NULL, 0);
    if (pci->version != NVML_PCI_INFO_EXT_V1_VERSION)
        END(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    pci->domain = d.g->pci.domain;
    pci->bus = d.g->pci.bus;
    pci->device = d.g->pci.device;
    pci->pciDeviceId = d.g->pci_device_id;
    pci->pciSubSystemId = d.g->pci_subsystem_id;
    pci->baseClass = (d.g->pci_class >> 8) & 0xff;
    pci->subClass = d.g->pci_class & 0xff;
    memset(pci->busId, 0, sizeof pci->busId);
    format_busid(&d.g->pci, pci->busId, sizeof pci->busId);
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* Health                                                                   */
/* ------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, unsigned int errorType,
                                         unsigned int counterType, unsigned long long *eccCounts)
{
    DEV_ENTER(device, eccCounts != NULL, 0);
    if (errorType > NVML_MEMORY_ERROR_TYPE_UNCORRECTED || counterType > NVML_AGGREGATE_ECC)
        END(NVML_ERROR_INVALID_ARGUMENT);
    if (!d.g->ecc_enabled)
        END(NVML_ERROR_NOT_SUPPORTED);
    *eccCounts = errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED ? d.g->ecc_uncorrected
                                                                 : d.g->ecc_corrected;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, unsigned int *isPending)
{
    DEV_ENTER(device, isPending != NULL, 0);
    *isPending = d.g->retired_pages_pending;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred)
{
    DEV_ENTER(device, corrRows && uncRows && isPending && failureOccurred, 0);
    *corrRows = d.g->remapped_corrected;
    *uncRows = d.g->remapped_uncorrected;
    *isPending = d.g->remapped_pending;
    *failureOccurred = d.g->remapped_failure;
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* MIG                                                                      */
/* ------------------------------------------------------------------------ */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    DEV_ENTER(device, currentMode != NULL && pendingMode != NULL, 0);
    if (!d.g->mig_capable)
        END(NVML_ERROR_NOT_SUPPORTED);
    *currentMode = d.g->mig_mode;
    *pendingMode = d.g->pending_mig_mode;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    DEV_ENTER(device, count != NULL, 0);
    *count = d.g->mig_capable ? d.g->max_mig : 0;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 nvmlDevice_t *migDevice)
{
    DEV_ENTER(device, migDevice != NULL, 0);
    if (!d.g->mig_capable)
        END(NVML_ERROR_NOT_SUPPORTED);
    if (index >= d.g->max_mig)
        END(NVML_ERROR_INVALID_ARGUMENT);
    if (!d.g->mig_mode || !d.g->migs[index].present)
        END(NVML_ERROR_NOT_FOUND);
    *migDevice = &g_mig_handles[d.gpu][index];
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    DEV_ENTER(device, isMigDevice != NULL, ALLOW_MIG);
    *isMigDevice = (unsigned int)d.is_mig;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    DEV_ENTER(device, id != NULL, ALLOW_MIG);
    if (!d.m)
        END(NVML_ERROR_NOT_SUPPORTED);
    *id = d.m->gi;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    DEV_ENTER(device, id != NULL, ALLOW_MIG);
    if (!d.m)
        END(NVML_ERROR_NOT_SUPPORTED);
    *id = d.m->ci;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    DEV_ENTER(migDevice, device != NULL, ALLOW_MIG);
    if (!d.m)
        END(NVML_ERROR_INVALID_ARGUMENT);
    *device = d.parent;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    DEV_ENTER(device, attributes != NULL, ALLOW_MIG);
    if (!d.m)
        END(NVML_ERROR_NOT_SUPPORTED); /* NVML only answers this for MIG devices */
    attributes->multiprocessorCount = d.m->sms;
    attributes->sharedCopyEngineCount = d.m->copy_engines;
    attributes->sharedDecoderCount = d.m->decoders;
    attributes->sharedEncoderCount = d.m->encoders;
    attributes->sharedJpegCount = d.m->jpegs;
    attributes->sharedOfaCount = d.m->ofas;
    attributes->gpuInstanceSliceCount = d.m->slices;
    attributes->computeInstanceSliceCount = d.m->ci_slices;
    attributes->memorySizeMB = d.m->memory_total >> 20;
    END(NVML_SUCCESS);
}

typedef struct fake_device *nvmlGpuInstance_t;

typedef struct {
    unsigned int start;
    unsigned int size;
} nvmlGpuInstancePlacement_t;

typedef struct {
    nvmlDevice_t device;
    unsigned int id;
    unsigned int profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;

nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id, nvmlGpuInstance_t *gpuInstance)
{
    DEV_ENTER(device, gpuInstance != NULL, 0);
    if (!d.g->mig_capable || !d.g->mig_mode)
        END(NVML_ERROR_NOT_SUPPORTED);
    for (unsigned int s = 0; s < MAX_MIG; s++)
        if (d.g->migs[s].present && d.g->migs[s].gi == id) {
            *gpuInstance = &g_gi_handles[d.gpu][s];
            END(NVML_SUCCESS);
        }
    END(NVML_ERROR_NOT_FOUND);
}

nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info)
{
    nvmlReturn_t rc = begin(__func__);
    if (rc != NVML_SUCCESS)
        END(rc);
    uintptr_t p = (uintptr_t)gpuInstance, base = (uintptr_t)g_gi_handles;
    size_t sz = sizeof(struct fake_device);
    if (!info || p < base || p >= base + sizeof g_gi_handles || (p - base) % sz)
        END(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int i = (unsigned int)((p - base) / sz), gpu = i / MAX_MIG, slot = i % MAX_MIG;
    if (gpu >= g_cfg.ngpus)
        END(NVML_ERROR_INVALID_ARGUMENT);
    struct gpu *g = &g_cfg.gpus[gpu];
    if (g->lost)
        END(NVML_ERROR_GPU_IS_LOST);
    if (namelist_has(&g_cfg.unsupported, __func__) || namelist_has(&g->unsupported, __func__))
        END(NVML_ERROR_NOT_SUPPORTED);
    const struct mig *m = &g->migs[slot];
    if (!g->mig_mode || !m->present) /* a destroyed instance: its handle is stale */
        END(NVML_ERROR_INVALID_ARGUMENT);
    info->device = &g_gpu_handles[gpu];
    info->id = m->gi;
    info->profileId = m->profile_id;
    info->placement.start = m->placement_start;
    info->placement.size = m->placement_size;
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* NVSwitch fabric (nvmlDeviceGetGpuFabricInfo, nvmlDeviceGetGpuFabricInfoV)  */
/* ------------------------------------------------------------------------ */

#define NVML_GPU_FABRIC_UUID_LEN 16
#define NVML_GPU_FABRIC_STATE_NOT_SUPPORTED 0
#define NVML_GPU_FABRIC_INFO_V2_VERSION 0x02000024u
#define NVML_DEVICE_ARCH_HOPPER 9

typedef struct {
    unsigned char clusterUuid[NVML_GPU_FABRIC_UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
} nvmlGpuFabricInfo_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[NVML_GPU_FABRIC_UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
    unsigned int healthMask;
} nvmlGpuFabricInfo_v2_t;

/* The fabric facts of a GPU; NOT_SUPPORTED before Hopper, as the real library answers there. */
static nvmlReturn_t fabric_of(const struct gpu *g, unsigned char *uuid, nvmlReturn_t *status,
                              unsigned int *clique, unsigned int *state)
{
    if (g->architecture < NVML_DEVICE_ARCH_HOPPER)
        return NVML_ERROR_NOT_SUPPORTED;
    memset(uuid, 0, NVML_GPU_FABRIC_UUID_LEN);
    *status = NVML_SUCCESS;
    *clique = 0;
    *state = NVML_GPU_FABRIC_STATE_NOT_SUPPORTED;
    if (g->fabric_state == UNSET_U32)
        return NVML_SUCCESS;
    *state = g->fabric_state;
    *clique = g->fabric_clique;
    unsigned int n = 0; /* the UUID's hex digits, dashes skipped */
    for (const char *c = g->fabric_cluster_uuid; *c && n < 2 * NVML_GPU_FABRIC_UUID_LEN; c++) {
        if (!isxdigit((unsigned char)*c))
            continue;
        unsigned int v = (unsigned int)(isdigit((unsigned char)*c) ? *c - '0' : (tolower(*c) - 'a' + 10));
        uuid[n / 2] = (unsigned char)(uuid[n / 2] | (n % 2 ? v : v << 4));
        n++;
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *info)
{
    DEV_ENTER(device, info != NULL, 0);
    END(fabric_of(d.g, info->clusterUuid, &info->status, &info->cliqueId, &info->state));
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfo_v2_t *info)
{
    DEV_ENTER(device, info != NULL, 0);
    if (info->version != NVML_GPU_FABRIC_INFO_V2_VERSION)
        END(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    info->healthMask = 0;
    END(fabric_of(d.g, info->clusterUuid, &info->status, &info->cliqueId, &info->state));
}

/* ------------------------------------------------------------------------ */
/* Topology and NVLink                                                      */
/* ------------------------------------------------------------------------ */

static int gpu_at(const struct pciaddr *a)
{
    for (unsigned int i = 0; i < g_cfg.ngpus; i++)
        if (pci_eq(&g_cfg.gpus[i].pci, a))
            return (int)i;
    return -1;
}

static int nvlink_connected(const struct gpu *a, const struct gpu *b)
{
    for (unsigned int i = 0; i < a->links.n; i++) {
        const struct pciaddr *r = &a->links.remote[i];
        if (pci_eq(r, &b->pci))
            return 1;
        if (gpu_at(r) >= 0)
            continue; /* a link to some third GPU */
        for (unsigned int j = 0; j < b->links.n; j++)
            if (pci_eq(r, &b->links.remote[j]))
                return 1; /* same NVSwitch */
    }
    for (unsigned int j = 0; j < b->links.n; j++)
        if (pci_eq(&b->links.remote[j], &a->pci))
            return 1;
    return 0;
}

static nvmlReturn_t second_device(nvmlDevice_t h, struct dev *d2)
{
    if (!resolve(h, d2))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (d2->g->lost)
        return NVML_ERROR_GPU_IS_LOST;
    if (d2->is_mig)
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                 unsigned int *pathInfo)
{
    DEV_ENTER(device1, pathInfo != NULL, 0);
    struct dev d2;
    nvmlReturn_t rc = second_device(device2, &d2);
    if (rc != NVML_SUCCESS)
        END(rc);
    const struct gpu *a = d.g, *b = d2.g;
    if (d.gpu == d2.gpu)
        *pathInfo = NVML_TOPOLOGY_INTERNAL;
    else if (a->pcie_switch >= 0 && a->pcie_switch == b->pcie_switch)
        *pathInfo = NVML_TOPOLOGY_SINGLE;
    else if (a->host_bridge >= 0 && a->host_bridge == b->host_bridge)
        *pathInfo = NVML_TOPOLOGY_HOSTBRIDGE;
    else if (a->numa >= 0 && a->numa == b->numa)
        *pathInfo = NVML_TOPOLOGY_NODE;
    else
        *pathInfo = NVML_TOPOLOGY_SYSTEM;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2, unsigned int p2pIndex,
                                    unsigned int *p2pStatus)
{
    DEV_ENTER(device1, p2pStatus != NULL, 0);
    struct dev d2;
    nvmlReturn_t rc = second_device(device2, &d2);
    if (rc != NVML_SUCCESS)
        END(rc);
    if (p2pIndex >= NVML_P2P_CAPS_INDEX_UNKNOWN)
        END(NVML_ERROR_INVALID_ARGUMENT);
    if (p2pIndex == NVML_P2P_CAPS_INDEX_NVLINK && d.gpu != d2.gpu)
        *p2pStatus = nvlink_connected(d.g, d2.g) ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED;
    else
        *p2pStatus = NVML_P2P_STATUS_OK;
    END(NVML_SUCCESS);
}

/* Links below nvlink_links exist; those below links.n are active. */
static nvmlReturn_t check_link(const struct gpu *g, unsigned int link)
{
    if (link >= NVML_NVLINK_MAX_LINKS)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (link >= g->nvlink_links)
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, unsigned int *isActive)
{
    DEV_ENTER(device, isActive != NULL, 0);
    nvmlReturn_t rc = check_link(d.g, link);
    if (rc == NVML_SUCCESS)
        *isActive = link < d.g->links.n;
    END(rc);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    DEV_ENTER(device, pci != NULL, 0);
    nvmlReturn_t rc = check_link(d.g, link);
    if (rc != NVML_SUCCESS)
        END(rc);
    if (link >= d.g->links.n)
        END(NVML_ERROR_NOT_SUPPORTED); /* inactive link: nothing on the other end */
    const struct pciaddr *r = &d.g->links.remote[link];
    int peer = gpu_at(r);
    if (peer >= 0)
        fill_pci(pci, r, g_cfg.gpus[peer].pci_device_id, g_cfg.gpus[peer].pci_subsystem_id);
    else
        fill_pci(pci, r, 0x1AF110DE, 0x000010DE); /* NVSwitch */
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                 unsigned int *pNvLinkDeviceType)
{
    DEV_ENTER(device, pNvLinkDeviceType != NULL, 0);
    nvmlReturn_t rc = check_link(d.g, link);
    if (rc != NVML_SUCCESS)
        END(rc);
    if (link >= d.g->links.n)
        END(NVML_ERROR_NOT_SUPPORTED);
    *pNvLinkDeviceType = gpu_at(&d.g->links.remote[link]) >= 0 ? NVML_NVLINK_DEVICE_TYPE_GPU
                                                              : NVML_NVLINK_DEVICE_TYPE_SWITCH;
    END(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------ */
/* Events                                                                   */
/* ------------------------------------------------------------------------ */

static struct fake_event_set *find_set(const struct fake_event_set *set)
{
    for (struct fake_event_set *s = g_sets; s; s = s->next)
        if (s == set)
            return s;
    return NULL;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    DEV_ENTER(device, eventTypes != NULL, 0);
    *eventTypes = d.g->supported_events;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    SYS_ENTER(set != NULL);
    struct fake_event_set *s = calloc(1, sizeof *s);
    if (!s)
        END(NVML_ERROR_UNKNOWN);
    s->next = g_sets;
    g_sets = s;
    *set = s;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    DEV_ENTER(device, 1, 0);
    struct fake_event_set *s = find_set(set);
    if (!s)
        END(NVML_ERROR_INVALID_ARGUMENT);
    if (eventTypes & ~d.g->registrable_events)
        END(NVML_ERROR_NOT_SUPPORTED);
    s->mask[d.gpu] |= eventTypes;
    END(NVML_SUCCESS);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    SYS_ENTER(1);
    for (struct fake_event_set **pp = &g_sets; *pp; pp = &(*pp)->next) {
        if (*pp == set) {
            struct fake_event_set *s = *pp;
            *pp = s->next;
            free_set(s);
            END(NVML_SUCCESS);
        }
    }
    END(NVML_ERROR_INVALID_ARGUMENT);
}

static unsigned long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

#define POLL_NS 5000000ULL

static nvmlReturn_t event_wait(const char *fn, nvmlEventSet_t set, nvmlEventData_t *out, unsigned int timeoutms)
{
    unsigned long long deadline = now_ns() + (unsigned long long)timeoutms * 1000000ULL;
    for (;;) {
        nvmlReturn_t rc = begin_sys(fn, out != NULL);
        if (rc != NVML_SUCCESS)
            END(rc);
        struct fake_event_set *s = find_set(set);
        if (!s)
            END(NVML_ERROR_INVALID_ARGUMENT);
        struct event *e = s->head;
        if (e) {
            s->head = e->next;
            if (!s->head)
                s->tail = NULL;
            out->device = &g_gpu_handles[e->gpu];
            out->eventType = e->type;
            out->eventData = e->data;
            out->gpuInstanceId = e->gi;
            out->computeInstanceId = e->ci;
            rc = e->lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
            free(e);
            END(rc);
        }
        pthread_mutex_unlock(&g_lock); /* never sleep holding the lock */
        unsigned long long now = now_ns();
        if (now >= deadline)
            return NVML_ERROR_TIMEOUT;
        unsigned long long nap = deadline - now < POLL_NS ? deadline - now : POLL_NS;
        struct timespec ts = {(time_t)(nap / 1000000000ULL), (long)(nap % 1000000000ULL)};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
            ;
    }
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return event_wait(__func__, set, data, timeoutms);
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_v1_t *data, unsigned int timeoutms)
{
    nvmlEventData_t full;
    nvmlReturn_t rc = event_wait(__func__, set, data ? &full : NULL, timeoutms);
    if (data && (rc == NVML_SUCCESS || rc == NVML_ERROR_GPU_IS_LOST)) {
        data->device = full.device;
        data->eventType = full.eventType;
        data->eventData = full.eventData;
    }
    return rc;
}
