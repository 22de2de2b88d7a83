// Sum all-reduce, reduce-scatter, all-gather and all-to-all between the processes of one machine through shared memory,
// for tensor-parallel ranks on the same host: a gloo all-reduce over loopback costs about a
// millisecond here (socket round trips and wake-ups), this a copy in, a wait on flags and a sum.
//
// Segment layout: one 64-byte line per rank (the last call it published, its process id, the last
// call it finished reading), then two buffers of `world` slots of `capacity` bytes each. Call s
// (counted per group, the same on every rank) copies this rank's part into slot [s % 2][rank],
// publishes s, waits until every rank published s, reads the slots (a sum in rank order with fp32
// accumulation, so every rank computes the same bits, or its pieces of the others' parts) and
// records s as read. Before writing buffer s % 2 again for call s + 2, a rank waits until every
// rank has read call s. A call may also be split in two, started (copied in and published) and
// later finished (waited for and read), so that work runs between the two: at most two calls of a
// group are then unfinished at once, which the two buffers hold. Tensors larger than a slot go
// through in pieces, each a call of its own. A rank that waits long checks that the others'
// processes still exist, and fails the call naming a rank that is gone rather than wait forever.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

namespace {

constexpr int64_t kFlagBytes = 64;

struct Group {
  int64_t rank, world, capacity;
  uint8_t* base;
  uint64_t calls = 0;  // calls started
  uint64_t read = 0;   // calls finished (read), in order

  std::atomic<uint64_t>& flag(int64_t r) const {
    return *reinterpret_cast<std::atomic<uint64_t>*>(base + r * kFlagBytes);
  }
  std::atomic<int64_t>& pid(int64_t r) const {
    return *reinterpret_cast<std::atomic<int64_t>*>(base + r * kFlagBytes + 8);
  }
  std::atomic<uint64_t>& done(int64_t r) const {
    return *reinterpret_cast<std::atomic<uint64_t>*>(base + r * kFlagBytes + 16);
  }
  uint8_t* slot(uint64_t call, int64_t r) const {
    return base + world * kFlagBytes + ((call & 1) * world + r) * capacity;
  }
};

std::vector<Group> groups;  // a group's handle is its index

int64_t shm_open_group(const std::string& name, int64_t rank, int64_t world, int64_t capacity) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world && capacity > 0 && capacity % 64 == 0,
              "shm_open_group: bad rank, world or capacity");
  const size_t size = world * kFlagBytes + 2 * world * capacity;
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "shm_open_group: cannot open shared memory ", name, ": ", std::strerror(errno));
  const bool sized = ftruncate(fd, static_cast<off_t>(size)) == 0;
  void* base = sized ? mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int err = errno;
  close(fd);
  TORCH_CHECK(base != MAP_FAILED, "shm_open_group: cannot map ", size, " bytes of ", name, ": ", std::strerror(err));
  groups.push_back(Group{rank, world, capacity, static_cast<uint8_t*>(base)});
  groups.back().pid(rank).store(getpid(), std::memory_order_release);
  return static_cast<int64_t>(groups.size()) - 1;
}

void shm_unlink_group(const std::string& name) { shm_unlink(name.c_str()); }

// Waits until every rank's counter (`flag` for published calls, `done` for read ones) reaches `call`.
template <typename Counter>
void wait_for_all(const Group& g, uint64_t call, Counter counter) {
  for (int64_t r = 0; r < g.world; ++r) {
    for (int64_t spins = 0; (g.*counter)(r).load(std::memory_order_acquire) < call; ++spins) {
      // Spin briefly (a rank is usually microseconds behind), then give the core away: ranks
      // may outnumber cores. Now and then, check that the rank waited for still exists.
      if (spins < 4096) {
        _mm_pause();
        continue;
      }
      sched_yield();
      if (spins % 65536 == 0) {
        const int64_t pid = g.pid(r).load(std::memory_order_acquire);
        TORCH_CHECK(!(pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH),
                    "shm_all_reduce: rank ", r, " (process ", pid, ") is gone");
      }
    }
  }
}

// out[i] = the sum over ranks of parts[r][i], in rank order.
template <typename T>
void sum_parts(const std::vector<const uint8_t*>& bytes, int64_t n, T* out) {
  std::vector<const T*> parts(bytes.size());
  for (size_t r = 0; r < bytes.size(); ++r) parts[r] = reinterpret_cast<const T*>(bytes[r]);
  for (int64_t i = 0; i < n; ++i) {
    float acc = static_cast<float>(parts[0][i]);
    for (size_t r = 1; r < parts.size(); ++r) acc += static_cast<float>(parts[r][i]);
    out[i] = static_cast<T>(acc);
  }
}

template <typename T>
void sum_slots(const Group& g, uint64_t call, int64_t n, T* out) {
  std::vector<const uint8_t*> parts(g.world);
  for (int64_t r = 0; r < g.world; ++r) parts[r] = g.slot(call, r);
  sum_parts(parts, n, out);
}

Group& group_of(int64_t handle) {
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(groups.size()), "shared-memory group ", handle,
              " was never opened");
  return groups[handle];
}

// Starts a call: copies `n` bytes in (once every rank has read what the buffer held) and publishes them.
uint64_t post(Group& g, const uint8_t* bytes, int64_t n) {
  TORCH_CHECK(g.calls - g.read < 2, "shared-memory group: a third call started while two are unfinished");
  const uint64_t call = ++g.calls;
  if (call > 2) wait_for_all(g, call - 2, &Group::done);
  std::memcpy(g.slot(call, g.rank), bytes, n);
  g.flag(g.rank).store(call, std::memory_order_release);
  return call;
}

// Finishes call `call` (the oldest unfinished one): waits for every rank's part, lets `take`
// read the slots, then records the call as read.
template <typename Take>
void finish(Group& g, uint64_t call, Take take) {
  TORCH_CHECK(call == g.read + 1, "shared-memory group: call ", call, " finished out of order (", g.read,
              " read so far)");
  wait_for_all(g, call, &Group::flag);
  take(call);
  g.read = call;
  g.done(g.rank).store(call, std::memory_order_release);
}

// Puts `src` through the group in pieces of at most one slot, each a call started and finished at
// once; `take(call, first element, elements)` reads the slots.
template <typename Take>
void exchange(Group& g, const at::Tensor& src, Take take) {
  const int64_t elem = src.element_size(), per_call = g.capacity / elem;
  const auto* in = static_cast<const uint8_t*>(src.data_ptr());
  for (int64_t start = 0; start < src.numel(); start += per_call) {
    const int64_t n = std::min(per_call, src.numel() - start);
    finish(g, post(g, in + start * elem, n * elem), [&](uint64_t call) { take(call, start, n); });
  }
}

at::Tensor shm_all_reduce(const at::Tensor& x, int64_t handle) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "shm_all_reduce: float32 or bfloat16 only, got ", x.scalar_type());
  Group& g = group_of(handle);
  const at::Tensor src = x.contiguous();
  at::Tensor out = at::empty_like(src);
  exchange(g, src, [&](uint64_t call, int64_t start, int64_t n) {
    if (src.scalar_type() == at::kFloat)
      sum_slots(g, call, n, out.data_ptr<float>() + start);
    else
      sum_slots(g, call, n, out.data_ptr<at::BFloat16>() + start);
  });
  return out.view(x.sizes());
}

// Every rank's x (all of the same shape) stacked in rank order: [world, *x.shape]. (`world`, the
// group's size, is an argument so that the output's shape is known without running the op.)
at::Tensor shm_all_gather(const at::Tensor& x, int64_t handle, int64_t world) {
  Group& g = group_of(handle);
  TORCH_CHECK(world == g.world, "shm_all_gather: group ", handle, " has ", g.world, " ranks, not ", world);
  const at::Tensor src = x.contiguous();
  std::vector<int64_t> shape{g.world};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end());
  at::Tensor out = at::empty(shape, src.options());
  const int64_t elem = src.element_size();
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  exchange(g, src, [&](uint64_t call, int64_t start, int64_t n) {
    for (int64_t r = 0; r < g.world; ++r)
      std::memcpy(dst + (r * src.numel() + start) * elem, g.slot(call, r), n * elem);
  });
  return out;
}

// Reduce-scatter: x [world, ...] holds a piece for each rank; returns the sum over the ranks of
// their piece for this one (fp32 accumulation in rank order, as the all-reduce).
at::Tensor shm_reduce_scatter(const at::Tensor& x, int64_t handle) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "shm_reduce_scatter: float32 or bfloat16 only, got ", x.scalar_type());
  Group& g = group_of(handle);
  TORCH_CHECK(x.dim() >= 1 && x.size(0) == g.world, "shm_reduce_scatter: x must hold a piece per rank along dim 0 (",
              g.world, "), got ", x.sizes());
  const at::Tensor src = x.contiguous();
  at::Tensor out = at::empty(x.sizes().slice(1), src.options());
  const int64_t piece = src.numel() / g.world, lo = g.rank * piece, hi = lo + piece;
  exchange(g, src, [&](uint64_t call, int64_t start, int64_t n) {
    const int64_t a = std::max(start, lo), b = std::min(start + n, hi);
    if (a >= b) return;
    std::vector<const uint8_t*> parts(g.world);
    const int64_t elem = src.element_size();
    for (int64_t r = 0; r < g.world; ++r) parts[r] = g.slot(call, r) + (a - start) * elem;
    if (src.scalar_type() == at::kFloat)
      sum_parts(parts, b - a, out.data_ptr<float>() + (a - lo));
    else
      sum_parts(parts, b - a, out.data_ptr<at::BFloat16>() + (a - lo));
  });
  return out;
}

// Copies this rank's pieces of call `call` (rank r's piece for this rank, elements [lo, hi) of
// every rank's x, in the slots from element `start` on) into out[r].
void read_pieces(const Group& g, uint64_t call, int64_t start, int64_t n, int64_t elem, int64_t piece,
                 uint8_t* dst) {
  const int64_t lo = g.rank * piece, hi = lo + piece;
  const int64_t a = std::max(start, lo), b = std::min(start + n, hi);
  if (a >= b) return;
  for (int64_t r = 0; r < g.world; ++r)
    std::memcpy(dst + (r * piece + a - lo) * elem, g.slot(call, r) + (a - start) * elem, (b - a) * elem);
}

void check_pieces(const Group& g, const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.size(0) == g.world, op, ": x must hold a piece per rank along dim 0 (", g.world,
              "), got ", x.sizes());
}

// All-to-all: x [world, ...] holds a piece for each rank; out[r] is the piece rank r's x holds for
// this rank. Each rank copies its whole x in and reads only its pieces.
at::Tensor shm_all_to_all(const at::Tensor& x, int64_t handle) {
  Group& g = group_of(handle);
  check_pieces(g, x, "shm_all_to_all");
  const at::Tensor src = x.contiguous();
  at::Tensor out = at::empty_like(src);
  const int64_t elem = src.element_size(), piece = src.numel() / g.world;
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  exchange(g, src, [&](uint64_t call, int64_t start, int64_t n) { read_pieces(g, call, start, n, elem, piece, dst); });
  return out;
}

// The all-to-all in two halves, so that other work runs while the other ranks catch up: start
// copies x (at most one slot) in and returns the call's ticket; wait reads this rank's pieces of
// that call, [world, ...] shaped as x. `after` only orders the wait after the tensors it lists
// (a compiled graph keeps an op after its inputs).
at::Tensor shm_all_to_all_start(const at::Tensor& x, int64_t handle) {
  Group& g = group_of(handle);
  check_pieces(g, x, "shm_all_to_all_start");
  const at::Tensor src = x.contiguous();
  TORCH_CHECK(src.nbytes() <= static_cast<size_t>(g.capacity), "shm_all_to_all_start: ", src.nbytes(),
              " bytes do not fit one slot of ", g.capacity);
  const uint64_t call = post(g, static_cast<const uint8_t*>(src.data_ptr()), src.nbytes());
  return at::full({}, static_cast<int64_t>(call), at::kLong);
}

at::Tensor shm_all_to_all_wait(const at::Tensor& ticket, const at::Tensor& x, int64_t handle, at::TensorList after) {
  Group& g = group_of(handle);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t elem = x.element_size(), piece = x.numel() / g.world;
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  finish(g, static_cast<uint64_t>(ticket.item<int64_t>()),
         [&](uint64_t call) { read_pieces(g, call, 0, x.numel(), elem, piece, dst); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loom, m) {
  m.def("shm_open_group(str name, int rank, int world, int capacity) -> int", &shm_open_group);
  m.def("shm_unlink_group(str name) -> ()", &shm_unlink_group);
  m.def("shm_all_reduce(Tensor x, int group) -> Tensor");
  m.def("shm_all_gather(Tensor x, int group, int world) -> Tensor");
  m.def("shm_all_to_all(Tensor x, int group) -> Tensor");
  m.def("shm_all_to_all_start(Tensor x, int group) -> Tensor");
  m.def("shm_all_to_all_wait(Tensor ticket, Tensor x, int group, Tensor[] after) -> Tensor");
  m.def("shm_reduce_scatter(Tensor x, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(loom, CPU, m) {
  m.impl("shm_all_reduce", &shm_all_reduce);
  m.impl("shm_all_gather", &shm_all_gather);
  m.impl("shm_all_to_all", &shm_all_to_all);
  m.impl("shm_all_to_all_start", &shm_all_to_all_start);
  m.impl("shm_all_to_all_wait", &shm_all_to_all_wait);
  m.impl("shm_reduce_scatter", &shm_reduce_scatter);
}
