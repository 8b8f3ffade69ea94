// The open hand-offs between running decode loops and the host (session_exchange.cc,
// token_stream.cc), by the id each loop carries as an operand: one compiled loop serves them all.

#ifndef TERRA_BACKENDS_NATIVE_HOST_REGISTRY_H_
#define TERRA_BACKENDS_NATIVE_HOST_REGISTRY_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace terra::native {

// Entries are shared: a loop keeps the one it found while the host forgets it. The registry
// itself is never destroyed, as a loop may still look an entry up while the process exits.
template <typename T>
class HostRegistry {
 public:
  static HostRegistry& Get() {
    static auto* registry = new HostRegistry;
    return *registry;
  }

  // Adds `entry` as `id`; false if the id is taken.
  bool Add(int32_t id, std::shared_ptr<T> entry) {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.emplace(id, std::move(entry)).second;
  }

  std::shared_ptr<T> Find(int32_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(id);
    return it == entries_.end() ? nullptr : it->second;
  }

  // Forgets `id` and returns its entry (null if there was none).
  std::shared_ptr<T> Remove(int32_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return nullptr;
    std::shared_ptr<T> entry = std::move(it->second);
    entries_.erase(it);
    return entry;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<int32_t, std::shared_ptr<T>> entries_;
};

}  // namespace terra::native

#endif  // TERRA_BACKENDS_NATIVE_HOST_REGISTRY_H_
