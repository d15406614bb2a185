// Tracking front end for c10's CPU allocator (see prism_launch/rank/cpu_hook.py).
//
// Built by cpu_hook.py against the c10 headers of the running torch, linked
// with -lc10 only, and loaded with ctypes: the extern "C" prism_mem_*
// functions at the end are its whole interface (their ctypes signatures are
// declared in cpu_hook.CpuHook). Every allocation through the redirected
// default CPU allocator, or through an allocator registered with
// c10::SetCPUAllocator, is counted here and its DataPtr gets a tracking deleter.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <exception>
#include <mutex>
#include <unordered_map>

namespace {

struct Block {
  std::int64_t n;
  c10::DataPtr inner;  // the block as the underlying allocator handed it out
};

constexpr int kShards = 64;
struct Shard {
  std::mutex m;
  std::unordered_map<void*, Block> map;
};
// Leaked on purpose: tensors may be freed during interpreter or library
// teardown, after static destructors of this library would have run.
Shard* const g_shards = new Shard[kShards];

inline Shard& shard_of(const void* p) {
  auto h = reinterpret_cast<std::uintptr_t>(p) >> 4;
  h *= 0x9E3779B97F4A7C15ull;
  return g_shards[(h >> 58) & (kShards - 1)];
}

std::atomic<std::int64_t> g_current{0};
std::atomic<std::int64_t> g_peak{0};
std::atomic<std::int64_t> g_unit_peak{0};
std::atomic<std::int64_t> g_limit{0};  // <= 0: no limit
std::atomic<std::int64_t> g_allocs{0};
std::atomic<std::int64_t> g_frees{0};
std::atomic<std::int64_t> g_foreign_frees{0};
std::atomic<std::int64_t> g_stale{0};
std::atomic<std::int64_t> g_ooms{0};
std::atomic<std::int64_t> g_alloc_bytes_total{0};

inline void raise_max(std::atomic<std::int64_t>& a, std::int64_t v) {
  std::int64_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

// Frees a tracked block; a pointer the table does not know (allocated before
// installation and released through raw_deallocate) goes to `fallback`.
inline void release(void* ptr, c10::DeleterFnPtr fallback) {
  if (ptr == nullptr) return;
  Shard& s = shard_of(ptr);
  std::unique_lock<std::mutex> lock(s.m);
  auto it = s.map.find(ptr);
  if (it == s.map.end()) {
    lock.unlock();
    g_foreign_frees.fetch_add(1, std::memory_order_relaxed);
    if (fallback != nullptr) fallback(ptr);
    return;
  }
  auto node = s.map.extract(it);
  lock.unlock();
  g_current.fetch_sub(node.mapped().n);
  g_frees.fetch_add(1, std::memory_order_relaxed);
  // `node` goes out of scope here: the inner DataPtr returns the memory.
}

// Counts `n` bytes about to be allocated; enforces the limit.
inline std::int64_t reserve(std::size_t n) {
  const auto sn = static_cast<std::int64_t>(n);
  const std::int64_t now = g_current.fetch_add(sn) + sn;
  const std::int64_t lim = g_limit.load(std::memory_order_relaxed);
  if (lim > 0 && now > lim) {
    g_current.fetch_sub(sn);
    g_ooms.fetch_add(1, std::memory_order_relaxed);
    // snprintf, not c10::str: no iostreams in this library (a toolchain may
    // link its own libstdc++ copy, whose locale facets are never initialised).
    char msg[256];
    std::snprintf(msg, sizeof(msg),
        "CPU out of memory: tried to allocate %lld bytes with %lld bytes already allocated; "
        "the emulated device's memory limit is %lld bytes (prism memory limit)",
        static_cast<long long>(sn), static_cast<long long>(now - sn), static_cast<long long>(lim));
    C10_THROW_ERROR(OutOfMemoryError, std::string(msg));
  }
  return now;
}

c10::DataPtr track(c10::DataPtr inner, std::int64_t n, std::int64_t now,
                   c10::DeleterFnPtr deleter) {
  void* data = inner.get();
  if (data == nullptr) {
    g_current.fetch_sub(n);
    return inner;
  }
  try {
    Shard& s = shard_of(data);
    std::lock_guard<std::mutex> lock(s.m);
    auto res = s.map.try_emplace(data, Block{n, c10::DataPtr()});
    if (!res.second) {
      // A stale entry: its block was released behind the table's back (a raw
      // deleter fetched before installation). The memory is already gone;
      // forget it without freeing it again.
      Block& old = res.first->second;
      (void)old.inner.release_context();
      g_current.fetch_sub(old.n);
      g_stale.fetch_add(1, std::memory_order_relaxed);
      old.n = n;
    }
    res.first->second.inner = std::move(inner);
  } catch (...) {
    g_current.fetch_sub(n);
    throw;
  }
  raise_max(g_peak, now);
  raise_max(g_unit_peak, now);
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  g_alloc_bytes_total.fetch_add(n, std::memory_order_relaxed);
  return c10::DataPtr(data, data, deleter, c10::Device(c10::DeviceType::CPU));
}

// Allocates `n` bytes from `inner_alloc`, counted and tracked, freed through `deleter`.
c10::DataPtr tracked_allocate(c10::Allocator* inner_alloc, std::size_t n,
                              c10::DeleterFnPtr deleter) {
  if (n == 0) return inner_alloc->allocate(0);
  const std::int64_t now = reserve(n);
  c10::DataPtr inner;
  try {
    inner = inner_alloc->allocate(n);
  } catch (...) {
    g_current.fetch_sub(static_cast<std::int64_t>(n));
    throw;
  }
  return track(std::move(inner), static_cast<std::int64_t>(n), now, deleter);
}

// ---- front end 1: the default CPU allocator object, redirected in place ----
// The default allocator is stateless (its only member is the vtable pointer),
// so a copy of that pointer is a working instance of the original.
struct OriginalDefault {
  void* vptr = nullptr;
};
OriginalDefault g_orig_default;
c10::DeleterFnPtr g_orig_default_raw = nullptr;
void* g_default_patched_vptr = nullptr;

inline c10::Allocator* orig_default() {
  return reinterpret_cast<c10::Allocator*>(&g_orig_default);
}

void default_delete(void* ptr) { release(ptr, g_orig_default_raw); }

struct DefaultFront final : c10::Allocator {
  c10::DataPtr allocate(std::size_t n) override {
    return tracked_allocate(orig_default(), n, &default_delete);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &default_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
DefaultFront* const g_default_front = new DefaultFront();

// ---- front end 2: a wrapper registered with SetCPUAllocator ----
std::atomic<c10::Allocator*> g_wrapped{nullptr};
c10::DeleterFnPtr g_wrapped_raw = nullptr;

void wrapper_delete(void* ptr) { release(ptr, g_wrapped_raw); }

struct WrapperFront final : c10::Allocator {
  c10::DataPtr allocate(std::size_t n) override {
    return tracked_allocate(g_wrapped.load(), n, &wrapper_delete);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &wrapper_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
WrapperFront* const g_wrapper_front = new WrapperFront();

std::mutex g_install_mutex;

}  // namespace

extern "C" {

// Bit 1: default allocator redirected; bit 2: registered allocator wrapped.
int prism_mem_install(int patch_default) {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  int state = 0;
  c10::Allocator* def = c10::GetDefaultCPUAllocator();
  void** def_obj = reinterpret_cast<void**>(def);
  if (patch_default) {
    if (g_default_patched_vptr == nullptr) {
      g_orig_default.vptr = def_obj[0];
      g_orig_default_raw = orig_default()->raw_deleter();
      g_default_patched_vptr = *reinterpret_cast<void**>(g_default_front);
      __atomic_store_n(&def_obj[0], g_default_patched_vptr, __ATOMIC_SEQ_CST);
    }
    state |= 1;
  }
  c10::Allocator* cur = c10::GetCPUAllocator();
  if (cur != def && cur != g_wrapper_front) {
    g_wrapped_raw = cur->raw_deleter();
    g_wrapped.store(cur);
    c10::SetCPUAllocator(g_wrapper_front, 255);
  }
  if (c10::GetCPUAllocator() == g_wrapper_front) state |= 2;
  return state;
}

int prism_mem_default_patched() { return g_default_patched_vptr != nullptr ? 1 : 0; }
int prism_mem_current_is_default() {
  return c10::GetCPUAllocator() == c10::GetDefaultCPUAllocator() ? 1 : 0;
}
std::int64_t prism_mem_current() { return g_current.load(); }
std::int64_t prism_mem_peak() { return g_peak.load(); }
std::int64_t prism_mem_unit_peak() { return g_unit_peak.load(); }
std::int64_t prism_mem_take_unit_peak() { return g_unit_peak.exchange(g_current.load()); }
void prism_mem_reset_peaks() {
  const std::int64_t c = g_current.load();
  g_peak.store(c);
  g_unit_peak.store(c);
}
void prism_mem_set_limit(std::int64_t limit) { g_limit.store(limit); }
std::int64_t prism_mem_limit() { return g_limit.load(); }
std::int64_t prism_mem_allocs() { return g_allocs.load(); }
std::int64_t prism_mem_frees() { return g_frees.load(); }
std::int64_t prism_mem_foreign_frees() { return g_foreign_frees.load(); }
std::int64_t prism_mem_stale() { return g_stale.load(); }
std::int64_t prism_mem_ooms() { return g_ooms.load(); }
std::int64_t prism_mem_alloc_bytes_total() { return g_alloc_bytes_total.load(); }
int prism_mem_is_tracked(void* p) {
  Shard& s = shard_of(p);
  std::lock_guard<std::mutex> lock(s.m);
  return s.map.count(p) ? 1 : 0;
}

}  // extern "C"
