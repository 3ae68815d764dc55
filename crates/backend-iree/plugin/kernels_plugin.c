// The IREE executable plugin through which IREE's CPU dispatches call seam's kernels.
//
// IREE loads executable plugins from shared libraries (`--executable_plugin=PATH`) and asks each
// to resolve the imports of the executables it loads. This library holds no kernels: the seam
// process that loads it first hands it a table of (name, function) pairs
// (`seam_kernels_plugin_set_table`), and `resolve` looks the imports up there. The kernels stay
// Rust code in the seam binary (crate cpu-kernels), compiled once for every backend.
//
// The structures below are those of IREE's `iree/hal/local/executable_plugin.h`, version 0.1
// of the plugin ABI, declared here so that the library builds without IREE's headers.

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PLUGIN_VERSION_0_1 0x00000001u
#define STATUS_NOT_FOUND 5u
#define RESOLUTION_MISSING_OPTIONAL 1u

typedef struct {
  uint32_t version;
  const char* name;
  const char* description;
  uint32_t features;
  int32_t sanitizer;
  uint64_t reserved[8];
} plugin_header_t;

typedef struct {
  size_t count;
  const char* const* symbol_names;
  void** out_fn_ptrs;
  void** out_fn_contexts;
} resolve_params_t;

typedef struct {
  const plugin_header_t* header;
  void* (*load)(const void* environment, size_t param_count, const void* params, void** out_self);
  void (*unload)(void* self);
  void* (*resolve)(void* self, const resolve_params_t* params, uint32_t* out_resolution);
} plugin_v0_t;

// One import the seam process provides.
typedef struct {
  const char* name;
  void* function;
  // Passed to every call of the import (one function may serve several imports, each with its
  // own context).
  void* context;
} seam_kernel_entry_t;

static const seam_kernel_entry_t* g_entries = NULL;
static size_t g_entry_count = 0;

// Called by the seam process, once, before IREE loads this library (the same loaded copy:
// dlopen of one path returns one instance). The table must live for the whole process.
__attribute__((visibility("default"))) void seam_kernels_plugin_set_table(
    const seam_kernel_entry_t* entries, size_t count) {
  g_entries = entries;
  g_entry_count = count;
}

static void* plugin_load(const void* environment, size_t param_count, const void* params,
                         void** out_self) {
  (void)environment;
  (void)param_count;
  (void)params;
  *out_self = NULL;
  return NULL;  // OK
}

static void plugin_unload(void* self) { (void)self; }

static void* plugin_resolve(void* self, const resolve_params_t* params, uint32_t* out_resolution) {
  (void)self;
  *out_resolution = 0;
  int missing_required = 0;
  for (size_t i = 0; i < params->count; ++i) {
    if (params->out_fn_ptrs[i]) continue;
    const char* name = params->symbol_names[i];
    int optional = name[0] == '?';
    if (optional) ++name;
    const seam_kernel_entry_t* found = NULL;
    for (size_t e = 0; e < g_entry_count; ++e) {
      if (strcmp(g_entries[e].name, name) == 0) {
        found = &g_entries[e];
        break;
      }
    }
    if (found) {
      params->out_fn_ptrs[i] = found->function;
      params->out_fn_contexts[i] = found->context;
    } else if (optional) {
      *out_resolution |= RESOLUTION_MISSING_OPTIONAL;
    } else {
      missing_required = 1;
    }
  }
  return missing_required ? (void*)(uintptr_t)STATUS_NOT_FOUND : NULL;
}

__attribute__((visibility("default"))) const plugin_header_t** iree_hal_executable_plugin_query(
    uint32_t max_version, void* reserved) {
  (void)reserved;
  static const plugin_header_t header = {
      .version = PLUGIN_VERSION_0_1,
      .name = "seam_kernels",
      .description = "seam's CPU kernels (crate cpu-kernels), resolved from the seam process",
      .features = 0,
      .sanitizer = 0,
  };
  static const plugin_v0_t plugin = {
      .header = &header,
      .load = plugin_load,
      .unload = plugin_unload,
      .resolve = plugin_resolve,
  };
  return max_version >= PLUGIN_VERSION_0_1 ? (const plugin_header_t**)&plugin : NULL;
}
