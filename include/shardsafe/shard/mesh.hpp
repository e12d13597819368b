// shardsafe/shard/mesh.hpp - device meshes and DTensor placements, turned into shard specs.
//
// A device mesh arranges the world's ranks in an N-D grid (shape [2, 4]: 8 ranks; rank r sits
// at the row-major coordinates of r, so rank 5 is at [1, 1]). A tensor is laid out on it by one
// placement per mesh dimension, as torch.distributed.tensor (DTensor) does:
//
//   shard(d)     tensor dimension d is split along this mesh dimension into torch.chunk
//                pieces: with n elements and k ranks, piece i starts at i * ceil(n / k) and
//                holds min(ceil(n / k), n - start) elements; trailing pieces may be smaller,
//                and when ceil(n / k) * i >= n, empty (torch.chunk then returns fewer pieces;
//                DTensor gives the ranks past them an empty tensor).
//   replicate()  every rank along this mesh dimension holds the same data.
//
// Several mesh dimensions may shard the same tensor dimension: they nest from left to right
// (the first splits the whole extent, the next splits the piece the first gave, ...), as
// DTensor's compute_local_shape_and_global_offset does. The common layouts:
//
// | layout                       | mesh              | placements (weight [out, in])          |
// |------------------------------|-------------------|----------------------------------------|
// | FSDP2                        | [W]               | [shard(0)]                             |
// | TP column / row parallel     | [W]               | [shard(0)] / [shard(1)]                |
// | HSDP (R replicas of F shards)| [R, F]            | [replicate(), shard(0)]                |
// | FSDP + TP                    | [F, T]            | [shard(0), shard(0)] or [shard(0), shard(1)] |
// | HSDP + TP                    | [R, F, T]         | [replicate(), shard(0), shard(1)]      |
//
// mesh_block(full, mesh, placements) is this rank's block (block_spec: local shape at a global
// offset). A rank whose piece is empty along some dimension holds nothing: its block has a 0
// extent there (local_numel() == 0, holds_nothing() is true) and, as in DTensor since torch 2.5,
// its offset along that dimension is the full extent (a value no real piece starts at). The
// result is a block, never an optional: in flat_view, a spec of nullopt means "the whole
// tensor", the opposite of "nothing", and an empty block needs no special case anywhere
// (plan_load returns an empty plan for it, a save writes zero bytes).
//
// Replicas. Ranks that differ only in their coordinates along replicate() dimensions hold the
// same block; no two ranks that differ along a shard() dimension hold the same non-empty block
// (torch.chunk pieces are disjoint). mesh_replicas() numbers them:
//   block_index    this rank's coordinates over the shard() dimensions, row-major
//   replica_index  its coordinates over the replicate() dimensions, row-major (0 .. R-1)
//   writer         the replica chosen to write the block: (block_index + salt) mod R.
// Consecutive blocks are thus written by consecutive replicas, so each replica writes about
// 1/R of a tensor's blocks; `salt` (e.g. the tensor's position in the state dict) also spreads
// tensors that are not sharded at all (norms, biases: one block, block_index 0) over the
// replicas instead of putting them all on replica 0. A rank whose block is empty writes nothing.
//
// Not modelled: DTensor's Partial placement (pending reductions are not checkpoint data) and
// _StridedShard (FSDP2 over TP's right-to-left order); both are out of scope here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardsafe/core/config.hpp"
#include "shardsafe/core/error.hpp"
#include "shardsafe/core/shape.hpp"
#include "shardsafe/detail/checked.hpp"
#include "shardsafe/shard/shard_spec.hpp"

namespace shardsafe {

// ---------------------------------------------------------------------------------------
// placements

/// How a tensor is laid out along one mesh dimension: split (shard) or copied (replicate).
struct placement {
  enum class kind : std::uint8_t { replicate, shard };
  kind type = kind::replicate;
  std::size_t dim = 0;  ///< the tensor dimension split, for shard

  constexpr bool is_shard() const noexcept { return type == kind::shard; }
  constexpr bool is_replicate() const noexcept { return type == kind::replicate; }
  friend constexpr bool operator==(const placement&, const placement&) = default;
};

/// Split tensor dimension `tensor_dim` along this mesh dimension (DTensor's Shard(d)).
constexpr placement shard(std::size_t tensor_dim) noexcept { return {placement::kind::shard, tensor_dim}; }
/// Every rank along this mesh dimension holds the same data (DTensor's Replicate()).
constexpr placement replicate() noexcept { return {placement::kind::replicate, 0}; }

/// "Shard(1)" or "Replicate()", DTensor's spelling, for messages.
inline std::string to_string(const placement& p) {
  return p.is_shard() ? "Shard(" + std::to_string(p.dim) + ")" : std::string("Replicate()");
}
/// "[Replicate(), Shard(0)]".
inline std::string to_string(std::span<const placement> ps) {
  std::string s = "[";
  for (std::size_t i = 0; i < ps.size(); ++i) s += (i ? ", " : "") + to_string(ps[i]);
  return s + "]";
}

/// One torch.chunk piece along one dimension: `size` elements from `offset`.
struct chunk_extent {
  std::uint64_t offset = 0;
  std::uint64_t size = 0;
  friend constexpr bool operator==(const chunk_extent&, const chunk_extent&) = default;
};

/// Piece i of n elements split k ways as torch.chunk does (k >= 1, i < k): pieces of
/// ceil(n / k) elements from the start, the last non-empty one shorter, the rest empty. An
/// empty piece is placed at offset n.
constexpr chunk_extent torch_chunk(std::uint64_t n, std::uint64_t k, std::uint64_t i) noexcept {
  const std::uint64_t c = n / k + (n % k != 0);  // ceil(n / k) without overflow
  // c * i <= c * (k - 1) < n + k - c: no overflow for any n below 2^64 - k
  const std::uint64_t start = c * i;
  if (c == 0 || start >= n) return {n, 0};
  return {start, std::min(c, n - start)};
}

// ---------------------------------------------------------------------------------------
// the mesh

class device_mesh {
 public:
  /// The mesh of this shape with this rank at its row-major coordinates. dim_names may be
  /// empty (the dimensions are then unnamed) or give one distinct name per dimension.
  device_mesh(shape_t shape, std::vector<std::string> dim_names, std::uint64_t rank)
      : shape_(std::move(shape)), names_(std::move(dim_names)) {
    check_shape();
    if (rank >= size_)
      fail(errc::invalid_argument, "device_mesh " + to_string(shape_) + ": rank " + std::to_string(rank) +
                                       " is outside the mesh's " + std::to_string(size_) + " ranks");
    rank_ = rank;
    coords_ = coords_of(rank);
  }

  /// The mesh of this shape with this rank at the given coordinates.
  device_mesh(shape_t shape, std::vector<std::string> dim_names, shape_t coords)
      : shape_(std::move(shape)), names_(std::move(dim_names)) {
    check_shape();
    rank_ = rank_of(coords);
    coords_ = std::move(coords);
  }

  std::size_t ndim() const noexcept { return shape_.size(); }
  const shape_t& shape() const noexcept { return shape_; }
  const std::vector<std::string>& dim_names() const noexcept { return names_; }
  /// Number of ranks in the mesh.
  std::uint64_t size() const noexcept { return size_; }
  /// This rank, and its coordinates.
  std::uint64_t rank() const noexcept { return rank_; }
  const shape_t& coords() const noexcept { return coords_; }

  /// The index of the dimension called name; errc::not_found if none is.
  std::size_t dim_index(std::string_view name) const {
    for (std::size_t d = 0; d < names_.size(); ++d)
      if (names_[d] == name) return d;
    fail(errc::not_found, "device_mesh " + describe() + " has no dimension named '" + std::string(name) + "'");
  }
  /// The number of ranks along the dimension called name.
  std::uint64_t size(std::string_view name) const { return shape_[dim_index(name)]; }

  /// The row-major coordinates of rank r.
  shape_t coords_of(std::uint64_t r) const {
    if (r >= size_)
      fail(errc::invalid_argument, "device_mesh " + describe() + ": rank " + std::to_string(r) +
                                       " is outside the mesh's " + std::to_string(size_) + " ranks");
    shape_t c(shape_.size());
    for (std::size_t d = shape_.size(); d-- > 0;) {
      c[d] = r % shape_[d];
      r /= shape_[d];
    }
    return c;
  }
  /// The rank at these coordinates.
  std::uint64_t rank_of(std::span<const std::uint64_t> c) const {
    if (c.size() != shape_.size())
      fail(errc::invalid_argument, "device_mesh " + describe() + ": coordinates " + to_string(c) + " have " +
                                       std::to_string(c.size()) + " dimensions, the mesh " + std::to_string(ndim()));
    std::uint64_t r = 0;
    for (std::size_t d = 0; d < shape_.size(); ++d) {
      if (c[d] >= shape_[d])
        fail(errc::invalid_argument, "device_mesh " + describe() + ": coordinate " + std::to_string(c[d]) +
                                         " of dimension " + dim_label(d) + " is outside its " +
                                         std::to_string(shape_[d]) + " ranks");
      r = r * shape_[d] + c[d];
    }
    return r;
  }

  /// The same mesh as seen by rank r.
  device_mesh at_rank(std::uint64_t r) const { return device_mesh(shape_, names_, r); }

  /// "[2,4] ('replicate', 'shard')", for messages.
  std::string describe() const {
    std::string s = to_string(shape_);
    if (names_.empty()) return s;
    s += " (";
    for (std::size_t d = 0; d < names_.size(); ++d) s += (d ? ", '" : "'") + names_[d] + "'";
    return s + ")";
  }
  /// "1 ('tp')" or "1", for messages.
  std::string dim_label(std::size_t d) const {
    return names_.empty() ? std::to_string(d) : std::to_string(d) + " ('" + names_[d] + "')";
  }

  friend bool operator==(const device_mesh&, const device_mesh&) = default;

 private:
  void check_shape() {
    if (shape_.empty()) fail(errc::invalid_argument, "device_mesh: a mesh needs at least one dimension");
    auto n = detail::checked_numel(shape_);
    if (!n) fail(errc::invalid_argument, "device_mesh " + to_string(shape_) + ": more than 2^64 ranks");
    for (std::size_t d = 0; d < shape_.size(); ++d)
      if (shape_[d] == 0)
        fail(errc::invalid_argument,
             "device_mesh " + to_string(shape_) + ": dimension " + std::to_string(d) + " has no ranks");
    if (!names_.empty()) {
      if (names_.size() != shape_.size())
        fail(errc::invalid_argument, "device_mesh " + to_string(shape_) + ": " + std::to_string(names_.size()) +
                                         " dimension names for " + std::to_string(shape_.size()) + " dimensions");
      for (std::size_t a = 0; a < names_.size(); ++a)
        for (std::size_t b = a + 1; b < names_.size(); ++b)
          if (names_[a] == names_[b])
            fail(errc::invalid_argument, "device_mesh " + to_string(shape_) + ": dimensions " + std::to_string(a) +
                                             " and " + std::to_string(b) + " are both named '" + names_[a] + "'");
    }
    size_ = *n;
  }

  shape_t shape_;
  std::vector<std::string> names_;
  std::uint64_t size_ = 1;
  std::uint64_t rank_ = 0;
  shape_t coords_;
};

// ---------------------------------------------------------------------------------------
// placements -> blocks

/// Checks that placements fit the mesh and a tensor of shape full: one per mesh dimension,
/// each shard() naming a dimension the tensor has. Throws errc::invalid_spec naming ctx (the
/// tensor) and the rule.
inline void validate_placements(std::span<const std::uint64_t> full, std::span<const std::uint64_t> mesh_shape,
                                std::span<const placement> placements, std::string_view ctx) {
  if (placements.size() != mesh_shape.size())
    fail(errc::invalid_spec, std::string(ctx) + ": " + std::to_string(placements.size()) + " placements " +
                                 to_string(placements) + " for a mesh of " + std::to_string(mesh_shape.size()) +
                                 " dimensions " + to_string(mesh_shape) + "; DTensor needs one per mesh dimension");
  if (!detail::checked_numel(full))
    fail(errc::invalid_spec, std::string(ctx) + ": shape " + to_string(full) + " overflows 64 bits");
  for (std::size_t m = 0; m < placements.size(); ++m) {
    if (mesh_shape[m] == 0)
      fail(errc::invalid_spec, std::string(ctx) + ": mesh dimension " + std::to_string(m) + " has no ranks");
    if (placements[m].is_shard() && placements[m].dim >= full.size())
      fail(errc::invalid_spec, std::string(ctx) + ": placement " + to_string(placements[m]) + " on mesh dimension " +
                                   std::to_string(m) + " shards tensor dimension " + std::to_string(placements[m].dim) +
                                   " but shape " + to_string(full) + " has " + std::to_string(full.size()));
  }
}

/// The block the rank at `coords` of a mesh of shape mesh_shape holds of a tensor of shape
/// full laid out by placements: DTensor's compute_local_shape_and_global_offset. Errors
/// (errc::invalid_spec, errc::invalid_argument) start with ctx, which should name the tensor.
inline block_spec mesh_block_at(std::span<const std::uint64_t> full, std::span<const std::uint64_t> mesh_shape,
                                std::span<const std::uint64_t> coords, std::span<const placement> placements,
                                std::string_view ctx) {
  validate_placements(full, mesh_shape, placements, ctx);
  if (coords.size() != mesh_shape.size())
    fail(errc::invalid_argument,
         std::string(ctx) + ": coordinates " + to_string(coords) + " do not fit mesh " + to_string(mesh_shape));
  shape_t local(full.begin(), full.end()), offset(full.size(), 0);
  for (std::size_t m = 0; m < placements.size(); ++m) {
    if (coords[m] >= mesh_shape[m])
      fail(errc::invalid_argument, std::string(ctx) + ": coordinate " + std::to_string(coords[m]) +
                                       " of mesh dimension " + std::to_string(m) + " is outside its " +
                                       std::to_string(mesh_shape[m]) + " ranks");
    if (!placements[m].is_shard()) continue;
    const std::size_t d = placements[m].dim;
    const chunk_extent c = torch_chunk(local[d], mesh_shape[m], coords[m]);
    local[d] = c.size;
    offset[d] = c.size == 0 ? full[d] : offset[d] + c.offset;  // nested: within the piece so far
  }
  return block_spec(std::move(local), std::move(offset));
}

/// This rank's block of a tensor of shape full laid out on mesh by placements.
inline block_spec mesh_block(std::span<const std::uint64_t> full, const device_mesh& mesh,
                             std::span<const placement> placements, std::string_view ctx) {
  return mesh_block_at(full, mesh.shape(), mesh.coords(), placements, ctx);
}

inline block_spec mesh_block(std::span<const std::uint64_t> full, const device_mesh& mesh,
                             std::initializer_list<placement> placements, std::string_view ctx) {
  return mesh_block(full, mesh, std::span<const placement>(placements.begin(), placements.size()), ctx);
}

/// Every rank's block, indexed by rank (row-major coordinates): what a save under this mesh
/// writes, or what each rank of a load under it asks for (planning, benchmarks, tests).
SHARDSAFE_DECL std::vector<block_spec> mesh_blocks(std::span<const std::uint64_t> full,
                                                   std::span<const std::uint64_t> mesh_shape,
                                                   std::span<const placement> placements, std::string_view ctx);

/// Whether a block holds no element (an empty torch.chunk piece somewhere, or an empty tensor).
inline bool holds_nothing(const block_spec& b) noexcept { return b.local_numel() == 0; }

// ---------------------------------------------------------------------------------------
// replicas

/// Where a rank stands among the ranks holding the same block (see the header comment).
struct replica_info {
  std::uint64_t block_index = 0;    ///< coordinates over the shard() dimensions, row-major
  std::uint64_t block_count = 1;    ///< product of the shard() dimensions' sizes
  std::uint64_t replica_index = 0;  ///< coordinates over the replicate() dimensions, row-major
  std::uint64_t replica_count = 1;  ///< product of the replicate() dimensions' sizes
  std::uint64_t writer = 0;         ///< replica index of the rank that writes this block

  bool is_writer() const noexcept { return replica_index == writer; }
  friend constexpr bool operator==(const replica_info&, const replica_info&) = default;
};

/// The replica numbering of the rank at coords. salt shifts the writer choice (see above).
inline replica_info mesh_replicas_at(std::span<const std::uint64_t> mesh_shape, std::span<const std::uint64_t> coords,
                                     std::span<const placement> placements, std::uint64_t salt = 0) {
  if (placements.size() != mesh_shape.size() || coords.size() != mesh_shape.size())
    fail(errc::invalid_argument, "mesh_replicas: " + std::to_string(placements.size()) +
                                     " placements and coordinates " + to_string(coords) + " for mesh " +
                                     to_string(mesh_shape));
  replica_info r;
  r.block_count = 1;
  r.replica_count = 1;
  for (std::size_t m = 0; m < mesh_shape.size(); ++m) {
    if (placements[m].is_shard()) {
      r.block_index = r.block_index * mesh_shape[m] + coords[m];
      r.block_count *= mesh_shape[m];
    } else {
      r.replica_index = r.replica_index * mesh_shape[m] + coords[m];
      r.replica_count *= mesh_shape[m];
    }
  }
  r.writer = (r.block_index % r.replica_count + salt % r.replica_count) % r.replica_count;
  return r;
}

/// This rank's replica numbering on mesh.
inline replica_info mesh_replicas(const device_mesh& mesh, std::span<const placement> placements,
                                  std::uint64_t salt = 0) {
  return mesh_replicas_at(mesh.shape(), mesh.coords(), placements, salt);
}

/// The ranks that hold the same block as this rank (itself included), ascending: those that
/// differ from it only along replicate() dimensions. (Ranks whose blocks are empty all hold
/// nothing; they are not listed as replicas of each other unless they are by this rule.)
inline std::vector<std::uint64_t> replica_ranks(const device_mesh& mesh, std::span<const placement> placements) {
  if (placements.size() != mesh.ndim())
    fail(errc::invalid_argument,
         "replica_ranks: " + std::to_string(placements.size()) + " placements for mesh " + mesh.describe());
  std::vector<std::uint64_t> out;
  shape_t c = mesh.coords();
  for (std::size_t m = 0; m < c.size(); ++m)
    if (placements[m].is_replicate()) c[m] = 0;
  while (true) {
    out.push_back(mesh.rank_of(c));
    std::size_t m = c.size();
    while (m-- > 0) {  // odometer over the replicate() dimensions
      if (!placements[m].is_replicate()) continue;
      if (++c[m] < mesh.shape()[m]) break;
      c[m] = 0;
    }
    if (m == static_cast<std::size_t>(-1)) break;
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// The rank that writes this rank's block: the replica with replica index `writer`.
inline std::uint64_t writer_rank(const device_mesh& mesh, std::span<const placement> placements,
                                 std::uint64_t salt = 0) {
  const replica_info info = mesh_replicas(mesh, placements, salt);
  shape_t c = mesh.coords();
  std::uint64_t w = info.writer;
  for (std::size_t m = c.size(); m-- > 0;)  // the writer's coordinates over the replicate() dims
    if (placements[m].is_replicate()) {
      c[m] = w % mesh.shape()[m];
      w /= mesh.shape()[m];
    }
  return mesh.rank_of(c);
}

/// Whether this rank writes its block of a tensor of shape full: it is the chosen replica and
/// the block holds something.
inline bool writes_block(std::span<const std::uint64_t> full, const device_mesh& mesh,
                         std::span<const placement> placements, std::string_view ctx, std::uint64_t salt = 0) {
  return !holds_nothing(mesh_block(full, mesh, placements, ctx)) && mesh_replicas(mesh, placements, salt).is_writer();
}

}  // namespace shardsafe

#if defined(SHARDSAFE_HEADER_ONLY)
#include "shardsafe/shard/impl/mesh.ipp"
#endif
