/*
 * Fake NVML: the slice of libnvidia-ml.so.1 that pynvml calls for GPU health, with the real ABI
 * (nvmlReturn_t results, opaque device and event-set handles, nvmlEventData_t), so the agent's
 * sampler runs unchanged on a CPU machine. The devices are healthy H100-like GPUs until the
 * fault file (FAKE_NCCL_FAULTS, the one the fake NCCL and CUDA read) says otherwise:
 *   nvml_throttle G reasons   clocks held down for those reasons (thermal|power|hw|...)
 *   nvml_xid G code           one Xid critical-error event (again if the line is re-added)
 *   nvml_ecc G count          volatile uncorrected ECC errors
 *   nvml_nvlink G count       NVLink CRC errors on link 0
 * Environment: FAKE_NVML_GPUS (device count, default 8), FAKE_NVML_NVLINKS (active links per
 * device, default 4; 0: no NVLink, the calls answer NOT_SUPPORTED), FAKE_NVML_UNSUPPORTED
 * (comma-separated function names that answer NOT_SUPPORTED, as some GPUs do), and
 * FAKE_NVML_NO_DRIVER=1 (nvmlInit fails with DRIVER_NOT_LOADED). Device g's PCI address and UUID
 * are those the fake CUDA driver reports for physical GPU g (fk_pci.h).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fk_faults.h"
#include "fk_pci.h"

#define API __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum {
  NVML_SUCCESS = 0,
  NVML_ERROR_UNINITIALIZED = 1,
  NVML_ERROR_INVALID_ARGUMENT = 2,
  NVML_ERROR_NOT_SUPPORTED = 3,
  NVML_ERROR_INSUFFICIENT_SIZE = 7,
  NVML_ERROR_DRIVER_NOT_LOADED = 9,
  NVML_ERROR_TIMEOUT = 10,
};
enum { NVML_CLOCK_GRAPHICS = 0, NVML_CLOCK_SM = 1, NVML_CLOCK_MEM = 2, NVML_CLOCK_VIDEO = 3 };
enum { NVML_MEMORY_ERROR_TYPE_CORRECTED = 0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1 };
enum { NVML_NVLINK_ERROR_DL_CRC_FLIT = 2 };

#define EVENT_XID 0x8ULL
#define EVENT_SUPPORTED 0xBULL /* single/double-bit ECC, Xid */
#define MAX_GPUS 64
#define MAX_XIDS 64
#define SM_MAX_MHZ 1980u
#define MEM_MAX_MHZ 2619u

struct nvmlDevice_st {
  unsigned index;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct {
  nvmlDevice_t device;
  unsigned long long eventType;
  unsigned long long eventData;
  unsigned gpuInstanceId;
  unsigned computeInstanceId;
} nvmlEventData_t;

struct nvmlEventSet_st {
  unsigned long long types[MAX_GPUS]; /* per device, the registered event types */
};
typedef struct nvmlEventSet_st *nvmlEventSet_t;

static struct nvmlDevice_st g_devices[MAX_GPUS];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_inits;
/* Xid rules already delivered, so each line is one event; forgotten when its line goes. */
static struct fk_rule g_delivered[MAX_XIDS];
static int g_ndelivered;

static int env_int(const char *name, int fallback) {
  const char *s = getenv(name);
  return s == NULL || s[0] == '\0' ? fallback : atoi(s);
}

static unsigned gpu_count(void) {
  int n = env_int("FAKE_NVML_GPUS", 8);
  return n < 0 ? 0 : n > MAX_GPUS ? MAX_GPUS : (unsigned)n;
}

static int unsupported(const char *fn) {
  const char *list = getenv("FAKE_NVML_UNSUPPORTED");
  if (list == NULL) return 0;
  size_t n = strlen(fn);
  for (const char *p = strstr(list, fn); p != NULL; p = strstr(p + 1, fn))
    if ((p == list || p[-1] == ',') && (p[n] == '\0' || p[n] == ',')) return 1;
  return 0;
}

static nvmlReturn_t check(nvmlDevice_t d, const void *out, const char *fn) {
  if (g_inits <= 0) return NVML_ERROR_UNINITIALIZED;
  if (d == NULL || d < g_devices || d >= g_devices + gpu_count() || out == NULL)
    return NVML_ERROR_INVALID_ARGUMENT;
  return unsupported(fn) ? NVML_ERROR_NOT_SUPPORTED : NVML_SUCCESS;
}

/* The throttle reason bits of device index; 0 when it runs free. */
static unsigned long long throttle_bits(unsigned index) {
  struct fk_rule rules[32];
  int n = fk_fault_collect(FK_NVML_THROTTLE, rules, 32);
  unsigned long long bits = 0;
  for (int i = 0; i < n; i++)
    if (rules[i].a == (long)index) bits |= (unsigned long long)rules[i].b;
  return bits;
}

static double fault_value(enum fk_kind kind, unsigned index) {
  double v = 0;
  return fk_fault_find(kind, (long)index, -1, &v) ? v : 0;
}

API nvmlReturn_t nvmlInitWithFlags(unsigned flags) {
  (void)flags;
  if (env_int("FAKE_NVML_NO_DRIVER", 0)) return NVML_ERROR_DRIVER_NOT_LOADED;
  pthread_mutex_lock(&g_mu);
  for (unsigned i = 0; i < MAX_GPUS; i++) g_devices[i].index = i;
  g_inits++;
  pthread_mutex_unlock(&g_mu);
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
API nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

API nvmlReturn_t nvmlShutdown(void) {
  pthread_mutex_lock(&g_mu);
  nvmlReturn_t r = g_inits > 0 ? (g_inits--, NVML_SUCCESS) : NVML_ERROR_UNINITIALIZED;
  pthread_mutex_unlock(&g_mu);
  return r;
}

API const char *nvmlErrorString(nvmlReturn_t r) {
  switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    default: return "Unknown Error";
  }
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned length) {
  if (version == NULL || length < 8) return NVML_ERROR_INVALID_ARGUMENT;
  snprintf(version, length, "%s", "0.0.fake");
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *count) {
  if (g_inits <= 0) return NVML_ERROR_UNINITIALIZED;
  if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  *count = gpu_count();
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, nvmlDevice_t *device) {
  if (g_inits <= 0) return NVML_ERROR_UNINITIALIZED;
  if (device == NULL || index >= gpu_count()) return NVML_ERROR_INVALID_ARGUMENT;
  *device = &g_devices[index];
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned *index) {
  nvmlReturn_t r = check(d, index, "nvmlDeviceGetIndex");
  if (r == NVML_SUCCESS) *index = d->index;
  return r;
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned length) {
  nvmlReturn_t r = check(d, name, "nvmlDeviceGetName");
  if (r != NVML_SUCCESS) return r;
  if (length < 24) return NVML_ERROR_INSUFFICIENT_SIZE;
  snprintf(name, length, "%s", "Fake NVIDIA H100 80GB");
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned length) {
  nvmlReturn_t r = check(d, uuid, "nvmlDeviceGetUUID");
  if (r != NVML_SUCCESS) return r;
  if (length < 41) return NVML_ERROR_INSUFFICIENT_SIZE;
  snprintf(uuid, length, FK_UUID_FMT, d->index);
  return NVML_SUCCESS;
}

/* nvmlPciInfo_t as NVML 9.0+ lays it out; the address is the one the fake driver reports for the
 * same physical GPU (fk_pci.h), here with NVML's eight-digit domain. */
typedef struct {
  char busIdLegacy[16];
  unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
  char busId[32];
} nvmlPciInfo_t;

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) {
  nvmlReturn_t r = check(d, pci, "nvmlDeviceGetPciInfo_v3");
  if (r != NVML_SUCCESS) return r;
  memset(pci, 0, sizeof *pci);
  pci->domain = fk_pci_domain(d->index);
  pci->bus = fk_pci_bus(d->index);
  pci->pciDeviceId = 0x233010DEu; /* an H100 SXM */
  pci->pciSubSystemId = 0x16C110DEu;
  unsigned short domain = (unsigned short)pci->domain;
  unsigned char bus = (unsigned char)pci->bus;
  snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04hX:%02hhX:00.0", domain, bus);
  snprintf(pci->busId, sizeof pci->busId, "%08X:%02hhX:00.0", (unsigned)domain, bus);
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t d, int type, unsigned *mhz) {
  nvmlReturn_t r = check(d, mhz, "nvmlDeviceGetMaxClockInfo");
  if (r != NVML_SUCCESS) return r;
  *mhz = type == NVML_CLOCK_MEM ? MEM_MAX_MHZ : SM_MAX_MHZ;
  return NVML_SUCCESS;
}

/* A throttled GPU's SM clock: what the reasons typically cost on an H100 (thermal ~55%, power
 * cap ~71%, hardware slowdown ~51% of the maximum). */
API nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t d, int type, unsigned *mhz) {
  nvmlReturn_t r = check(d, mhz, "nvmlDeviceGetClockInfo");
  if (r != NVML_SUCCESS) return r;
  if (type == NVML_CLOCK_MEM) {
    *mhz = MEM_MAX_MHZ;
    return NVML_SUCCESS;
  }
  unsigned long long bits = throttle_bits(d->index);
  unsigned sm = SM_MAX_MHZ;
  if (bits & 0x4) sm = 1410;          /* software power cap */
  if (bits & 0x80) sm = 1200;         /* power brake */
  if (bits & 0x60) sm = 1095;         /* thermal */
  if (bits & 0x8) sm = 1005;          /* hardware slowdown */
  *mhz = sm;
  return NVML_SUCCESS;
}

static nvmlReturn_t reasons(nvmlDevice_t d, unsigned long long *out, const char *fn) {
  nvmlReturn_t r = check(d, out, fn);
  if (r == NVML_SUCCESS) *out = throttle_bits(d->index);
  return r;
}

API nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *out) {
  return reasons(d, out, "nvmlDeviceGetCurrentClocksEventReasons");
}

API nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t d, unsigned long long *out) {
  return reasons(d, out, "nvmlDeviceGetCurrentClocksThrottleReasons");
}

API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned *celsius) {
  nvmlReturn_t r = check(d, celsius, "nvmlDeviceGetTemperature");
  if (r != NVML_SUCCESS) return r;
  if (sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
  *celsius = throttle_bits(d->index) & 0x60 ? 87u : 62u + d->index % 4;
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned *milliwatts) {
  nvmlReturn_t r = check(d, milliwatts, "nvmlDeviceGetPowerUsage");
  if (r != NVML_SUCCESS) return r;
  *milliwatts = throttle_bits(d->index) & 0x84 ? 700000u : 452000u + 1000u * (d->index % 4);
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int error_type, int counter_type,
                                             unsigned long long *count) {
  nvmlReturn_t r = check(d, count, "nvmlDeviceGetTotalEccErrors");
  if (r != NVML_SUCCESS) return r;
  (void)counter_type;
  *count = error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED
               ? (unsigned long long)fault_value(FK_NVML_ECC, d->index)
               : 0;
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t d, unsigned *value) {
  nvmlReturn_t r = check(d, value, "nvmlDeviceGetPcieReplayCounter");
  if (r == NVML_SUCCESS) *value = 0;
  return r;
}

API nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned link, unsigned *active) {
  nvmlReturn_t r = check(d, active, "nvmlDeviceGetNvLinkState");
  if (r != NVML_SUCCESS) return r;
  int links = env_int("FAKE_NVML_NVLINKS", 4);
  if (links <= 0) return NVML_ERROR_NOT_SUPPORTED;
  if (link >= 18) return NVML_ERROR_INVALID_ARGUMENT;
  *active = link < (unsigned)links;
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t d, unsigned link, int counter,
                                                 unsigned long long *value) {
  nvmlReturn_t r = check(d, value, "nvmlDeviceGetNvLinkErrorCounter");
  if (r != NVML_SUCCESS) return r;
  int links = env_int("FAKE_NVML_NVLINKS", 4);
  if (links <= 0) return NVML_ERROR_NOT_SUPPORTED;
  if (link >= (unsigned)links) return NVML_ERROR_INVALID_ARGUMENT;
  *value = link == 0 && counter == NVML_NVLINK_ERROR_DL_CRC_FLIT
               ? (unsigned long long)fault_value(FK_NVML_NVLINK, d->index)
               : 0;
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types) {
  nvmlReturn_t r = check(d, types, "nvmlDeviceGetSupportedEventTypes");
  if (r == NVML_SUCCESS) *types = EVENT_SUPPORTED;
  return r;
}

API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
  if (g_inits <= 0) return NVML_ERROR_UNINITIALIZED;
  if (set == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  if (unsupported("nvmlEventSetCreate")) return NVML_ERROR_NOT_SUPPORTED;
  *set = calloc(1, sizeof **set);
  return *set == NULL ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
}

API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
  free(set);
  return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set) {
  nvmlReturn_t r = check(d, set, "nvmlDeviceRegisterEvents");
  if (r != NVML_SUCCESS) return r;
  if (types & ~EVENT_SUPPORTED) return NVML_ERROR_NOT_SUPPORTED;
  set->types[d->index] |= types;
  return NVML_SUCCESS;
}

static int was_delivered(const struct fk_rule *x) {
  for (int i = 0; i < g_ndelivered; i++)
    if (g_delivered[i].a == x->a && g_delivered[i].b == x->b) return 1;
  return 0;
}

/* One undelivered Xid for a device registered in set, marked delivered; 0 when none. Delivered
 * marks whose line is gone are forgotten, so a line written again is a new event. */
static int next_xid(nvmlEventSet_t set, nvmlEventData_t *data) {
  struct fk_rule rules[MAX_XIDS];
  int n = fk_fault_collect(FK_NVML_XID, rules, MAX_XIDS);
  int found = 0;
  pthread_mutex_lock(&g_mu);
  int kept = 0;
  for (int i = 0; i < g_ndelivered; i++) {
    int live = 0;
    for (int j = 0; j < n; j++) live |= rules[j].a == g_delivered[i].a && rules[j].b == g_delivered[i].b;
    if (live) g_delivered[kept++] = g_delivered[i];
  }
  g_ndelivered = kept;
  for (int j = 0; j < n && !found; j++) {
    long dev = rules[j].a;
    if (dev < 0 || dev >= (long)gpu_count() || !(set->types[dev] & EVENT_XID) || was_delivered(&rules[j]))
      continue;
    if (g_ndelivered < MAX_XIDS) g_delivered[g_ndelivered++] = rules[j];
    *data = (nvmlEventData_t){.device = &g_devices[dev], .eventType = EVENT_XID,
                              .eventData = (unsigned long long)rules[j].b};
    found = 1;
  }
  pthread_mutex_unlock(&g_mu);
  return found;
}

API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned timeout_ms) {
  if (g_inits <= 0) return NVML_ERROR_UNINITIALIZED;
  if (set == NULL || data == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  for (unsigned waited = 0;; waited++) {
    if (next_xid(set, data)) return NVML_SUCCESS;
    if (waited >= timeout_ms) return NVML_ERROR_TIMEOUT;
    nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
  }
}

API nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned timeout_ms) {
  return nvmlEventSetWait_v2(set, data, timeout_ms);
}
