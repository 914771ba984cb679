"""Persistent prefix cache: save a `PrefixCache` and its K/V to disk, restore it into a pool.

`save_prefix_cache` writes the tree (namespaces, edges, parents, pins, LRU order) and,
bit-exact, the K/V of every token it holds. `load_prefix_cache` validates the whole
file before touching the pool, writes the K/V compactly into free blocks and rebuilds
the tree on them, its references applied (`CachedPool.save` / `restore` wrap both).

File format, version 1: an uncompressed `.npz`, read with `allow_pickle=False`:
* `header`: `uint8[n]` UTF-8 JSON: `format` (`FORMAT_NAME`), `version`, `pool`
  (`num_layers, num_kv_heads, head_dim, dtype, block_size`), `namespaces` (typed
  entries `{"type": "str" | "int" | "bytes" (hex) | "tuple" (entries), "value"}`),
  `num_nodes`, `num_tokens`, `checksum` (`"sha256:<hex>"` over the canonical JSON
  without it, then each other member in name order: name, dtype, shape, bytes);
* `node_namespace` `i32[N]`; `node_parent` `i64[N]` (-1 under a root; parents first);
* `cu_tokens` `i64[N + 1]`: node i's edge is `tokens[cu[i]:cu[i + 1]]`, never empty;
* `tokens` `i32[T]`; `node_recency` `i64[N]` (LRU rank, 0 oldest);
* `node_pin_ttl` `f64[N]`: pin time left at save (0: none);
* `k`, `v`: `uint{8,16,32}[L, H, T, D]`, the raw bits of each token's K/V.
Locks, GC marks and hit statistics are not saved.

On load a node of `L` tokens takes `L // block_size` whole blocks and a best-fit slot
range for its tail in a block its namespace shares: the fewest blocks, lowest first.
A pool too small for the whole cache is refused (`PoolExhausted`).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import heapq
import io
import json
import os
import time
import zipfile
import zlib
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.core.errors import InvalidArgument, PagedKVError, PoolExhausted
from paged_kv.core.state import REGION_BASE
from paged_kv.pool.block_pool import BlockPool
from radix.cache import PrefixCache, RefDeltas

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ConfigMismatchError",
    "CorruptFileError",
    "MissingFileError",
    "PersistError",
    "UnsupportedNamespaceError",
    "UnreadableFileError",
    "UnsupportedVersionError",
    "UnwritableFileError",
    "load_prefix_cache",
    "remove_stale_temps",
    "save_prefix_cache",
]

FORMAT_NAME = "paged_kv.prefix_cache"
FORMAT_VERSION = 1

_GEOMETRY = ("num_layers", "num_kv_heads", "head_dim", "dtype")
_ARRAYS = ("node_namespace", "node_parent", "cu_tokens", "tokens", "node_recency",
           "node_pin_ttl", "k", "v")
_BITS_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}
# Temporary sequences opened per reserve_tokens call while loading.
_MAX_LOAD_BATCH = 32


class PersistError(PagedKVError):
  """Base class of the errors raised while saving or loading a prefix cache."""


class CorruptFileError(PersistError):
  """The file is truncated, not an archive of this format, or fails its checksum."""


class UnreadableFileError(PersistError, OSError):
  """The path cannot be read as a file (a directory, no permission, an I/O error).

  An `OSError` too, with the underlying `errno` and `filename`.
  """


class MissingFileError(UnreadableFileError, FileNotFoundError):
  """No file at the path (also a `FileNotFoundError`)."""


class UnwritableFileError(PersistError, OSError):
  """The file cannot be written (a directory at the path, no permission, disk full)."""


class UnsupportedVersionError(PersistError):
  """The file's format name or version is not one this library reads."""


class ConfigMismatchError(PersistError, ValueError):
  """The file's pool geometry (layers, kv heads, head_dim, dtype) differs from the pool's."""


class UnsupportedNamespaceError(PersistError, TypeError):
  """A namespace is not a typed key (str, bytes, int or a tuple of them)."""


# ----------------------------------------------------------------------------- encoding
_MAX_NAMESPACE_DEPTH = 32  # tuple nesting a file may hold (a deeper one is corrupt)


def _encode_namespace(namespace: Hashable) -> dict[str, Any]:
  """A JSON entry for a typed namespace key: `bytes` as hex, a tuple as its parts'
  entries, every part's type written, so `1` and `"1"` stay apart on load.
  """
  if type(namespace) is str:
    return {"type": "str", "value": namespace}
  if type(namespace) is int:
    return {"type": "int", "value": namespace}
  if type(namespace) is bytes:
    return {"type": "bytes", "value": namespace.hex()}
  if type(namespace) is tuple:
    return {"type": "tuple", "value": [_encode_namespace(part) for part in namespace]}
  raise UnsupportedNamespaceError(
      f"cannot persist namespace {namespace!r} of type {type(namespace).__name__}: only "
      f"str, bytes, int and tuples of them (the tree's typed keys) are supported")


def _decode_namespace(entry: Any, depth: int = 0) -> Hashable:
  """The namespace an `_encode_namespace` entry names; CorruptFileError otherwise."""
  kind = entry.get("type") if isinstance(entry, dict) else None
  value = entry.get("value") if isinstance(entry, dict) else None
  if kind == "str" and isinstance(value, str):
    return value
  if kind == "int" and type(value) is int:
    return value
  if kind == "bytes" and isinstance(value, str):
    try:
      return bytes.fromhex(value)
    except ValueError:
      pass
  if kind == "tuple" and isinstance(value, list) and depth < _MAX_NAMESPACE_DEPTH:
    return tuple(_decode_namespace(part, depth + 1) for part in value)
  raise CorruptFileError(f"bad namespace entry {entry!r} in the header")


def _checksum(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> str:
  """`"sha256:<hex>"` over the header (without `checksum`) and every array."""
  h = hashlib.sha256()
  body = {key: val for key, val in header.items() if key != "checksum"}
  h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
  for name in sorted(arrays):
    a = np.ascontiguousarray(arrays[name])
    h.update(f"\0{name}\0{a.dtype.str}\0{a.shape}\0".encode())
    h.update(a.data)
  return "sha256:" + h.hexdigest()


# ----------------------------------------------------------------------------- save
def save_prefix_cache(path: str | os.PathLike, pool: BlockPool, cache: PrefixCache) -> None:
  """Writes `cache`'s tree and the K/V of its segments (read from `pool`) to `path`.

  Written to `<path>.tmp-<pid>`, flushed and renamed over `path`: a crash leaves the
  old file or the new one whole (a stale temporary file is removed later).

  Raises:
    UnsupportedNamespaceError: a namespace is not a typed key (nothing written).
    UnwritableFileError: `path` cannot be written (nothing left behind).
    InvalidArgument: the block sizes differ, or a segment lies outside the pool.
  """
  config = pool.config
  bs = config.block_size
  if cache.block_size != bs:
    raise InvalidArgument(f"cache block_size {cache.block_size} != pool block_size {bs}")
  namespaces = cache.tree.namespaces()
  ns_entries = [_encode_namespace(ns) for ns in namespaces]
  ns_index = {ns: i for i, ns in enumerate(namespaces)}

  # Parents before children: a parent is shallower than its children.
  nodes = sorted(cache.tree.nodes(), key=lambda n: (ns_index[n.namespace], n.depth, n.node_id))
  position = {n.node_id: i for i, n in enumerate(nodes)}
  num_nodes = len(nodes)
  parent = np.array([-1 if n.parent is None or n.parent.parent is None
                     else position[n.parent.node_id] for n in nodes], np.int64)
  node_ns = np.array([ns_index[n.namespace] for n in nodes], np.int32)
  lengths = np.array([n.num_tokens for n in nodes], np.int64)
  cu_tokens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  tokens = (np.concatenate([n.key for n in nodes]).astype(np.int32) if num_nodes
            else np.zeros((0,), np.int32))
  order = sorted(range(num_nodes), key=lambda i: (nodes[i].last_access, nodes[i].access_seq))
  recency = np.empty((num_nodes,), np.int64)
  recency[order] = np.arange(num_nodes)
  now = cache.now()  # the clock pins use
  pin_ttl = np.array([max(n.pinned_until - now, 0.0) for n in nodes], np.float64)

  # Flat physical slot of every token of the stream, node by node, in token order.
  segs = [n.value for n in nodes if n.value.shape[0]]
  if segs:
    all_segs = np.concatenate(segs).astype(np.int64)
    if all_segs[:, 0].max() >= config.num_blocks:
      raise InvalidArgument(f"the cache references block {int(all_segs[:, 0].max())}; the "
                            f"pool has {config.num_blocks}")
    first = all_segs[:, 0] * bs + all_segs[:, 1]
    before = np.cumsum(all_segs[:, 2]) - all_segs[:, 2]  # tokens before each segment
    slots = np.repeat(first - before, all_segs[:, 2]) + np.arange(int(all_segs[:, 2].sum()))
  else:
    slots = np.zeros((0,), np.int64)
  if slots.shape[0] != cu_tokens[-1]:
    raise InvalidArgument(f"the cache's segments cover {slots.shape[0]} tokens, its nodes "
                          f"{int(cu_tokens[-1])}")
  bits = _BITS_DTYPES[config.jnp_dtype.itemsize]
  k, v = gather_tokens(pool, slots)
  arrays = {
      "node_namespace": node_ns, "node_parent": parent, "cu_tokens": cu_tokens,
      "tokens": tokens, "node_recency": recency, "node_pin_ttl": pin_ttl,
      "k": k.view(bits), "v": v.view(bits),
  }
  header = {
      "format": FORMAT_NAME, "version": FORMAT_VERSION,
      "pool": {"num_layers": config.num_layers, "num_kv_heads": config.num_kv_heads,
               "head_dim": config.head_dim, "dtype": config.dtype, "block_size": bs},
      "namespaces": ns_entries, "num_nodes": num_nodes, "num_tokens": int(cu_tokens[-1]),
  }
  header["checksum"] = _checksum(header, arrays)
  header_bytes = np.frombuffer(json.dumps(header, sort_keys=True).encode(), np.uint8)

  try:
    path = os.fspath(path)
  except TypeError as e:
    raise InvalidArgument(f"path must be a str or os.PathLike, got {path!r}") from e
  if os.path.isdir(path):
    raise UnwritableFileError(errno.EISDIR, f"cannot write a prefix-cache file over the "
                              f"directory {path!r}", path)
  remove_stale_temps(path)
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    with open(tmp, "wb") as f:
      np.savez(f, header=header_bytes, **arrays)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))  # the rename itself, durable
  except OSError as e:
    raise UnwritableFileError(e.errno, f"cannot write the prefix-cache file {path!r}: "
                              f"{e.strerror or e}", path) from e
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def _fsync_dir(directory: str) -> None:
  """Flushes a directory's entries (a rename into it) to disk, where the OS allows."""
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return  # e.g. no read permission on the directory: the rename still happened
  try:
    os.fsync(fd)
  except OSError:
    pass  # some file systems refuse fsync on directories
  finally:
    os.close(fd)


STALE_TEMP_SECONDS = 3600.0  # a temporary file untouched this long is stale, whoever wrote it


def _pid_running(pid: int) -> bool:
  """Whether a process with this id runs (or exists and is not ours to signal)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except (PermissionError, OverflowError, ValueError):
    return pid > 0  # another user's process runs under it (or the id is no pid)
  return True


def remove_stale_temps(path: str | os.PathLike, *,
                       max_age: float = STALE_TEMP_SECONDS) -> list[str]:
  """Removes the temporary files dead writers of `path` left; returns their paths.

  A `<path>.tmp-<pid>` is stale when no process runs under its pid or it is older
  than `max_age` seconds (a reused pid); writers in another pid namespace look dead.
  Errors are ignored: the cleanup never fails a save or a load.
  """
  try:
    path = os.path.abspath(os.fspath(path))
  except TypeError:
    return []
  directory, prefix = os.path.dirname(path), os.path.basename(path) + ".tmp-"
  try:
    names = [n for n in os.listdir(directory) if n.startswith(prefix)]
  except OSError:
    return []
  removed = []
  now = time.time()
  for name in names:
    pid_text = name[len(prefix):]
    if not pid_text.isdigit():
      continue
    full = os.path.join(directory, name)
    pid = int(pid_text)
    try:
      age = now - os.stat(full).st_mtime
      dead = pid != os.getpid() and not _pid_running(pid)
      if dead or age > max_age:
        os.remove(full)
        removed.append(full)
    except OSError:
      continue
  return removed


CHUNK_TOKENS = 4096
"""Tokens per K/V gather (save) and write (load): one program each, whatever the cache."""


def gather_tokens(pool: BlockPool, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`(k, v)`: `[L, H, T, D]` host arrays of the K/V at flat `slots: int[T]`, gathered
  in padded chunks of `CHUNK_TOKENS` (one program for any size).
  """
  c = pool.config
  num = int(slots.shape[0])
  shape = (c.num_layers, c.num_kv_heads, num, c.head_dim)
  k_out, v_out = np.empty(shape, c.jnp_dtype), np.empty(shape, c.jnp_dtype)
  state = pool.state
  for i in range(0, num, CHUNK_TOKENS):
    part = slots[i:i + CHUNK_TOKENS]
    padded = np.zeros((CHUNK_TOKENS,), np.int32)
    padded[:part.shape[0]] = part
    k, v = jax.device_get(_gather_slots(state.pages.k, state.pages.v, padded))
    pool.runtime.dispatch("data")
    pool.runtime.read("data")
    k_out[:, :, i:i + part.shape[0]] = k[:, :, :part.shape[0]]
    v_out[:, :, i:i + part.shape[0]] = v[:, :, :part.shape[0]]
  return k_out, v_out


def write_tokens(pool: BlockPool, slot_idx: np.ndarray, k: np.ndarray, v: np.ndarray,
                 seq_ids) -> None:
  """Writes `[L, H, T, D]` K/V at flat `slot_idx: int[T]` (-1 skipped) for the writers
  `seq_ids` (`int[T]`, or one sequence), in chunks of `CHUNK_TOKENS`
  (`BlockPool.write_kv_layers`: one program for any size)."""
  num = int(slot_idx.shape[0])
  writers = np.broadcast_to(np.asarray(seq_ids, np.int64), (num,))
  for i in range(0, num, CHUNK_TOKENS):
    part = slot_idx[i:i + CHUNK_TOKENS]
    idx = np.full((CHUNK_TOKENS,), -1, np.int32)
    idx[:part.shape[0]] = part
    who = np.zeros((CHUNK_TOKENS,), np.int64)  # padding's writer is never checked
    who[:part.shape[0]] = writers[i:i + CHUNK_TOKENS]
    pad = ((0, 0), (0, 0), (0, CHUNK_TOKENS - part.shape[0]), (0, 0))
    pool.write_kv_layers(idx, np.pad(k[:, :, i:i + CHUNK_TOKENS], pad),
                         np.pad(v[:, :, i:i + CHUNK_TOKENS], pad), seq_ids=who)


def warm_programs(pool: BlockPool) -> None:
  """Runs (compiles) the save's gather and the load's write, changing nothing."""
  c = pool.config
  gather_tokens(pool, np.zeros((1,), np.int32))
  zeros = np.zeros((c.num_layers, c.num_kv_heads, 1, c.head_dim), c.jnp_dtype)
  write_tokens(pool, np.full((1,), -1, np.int32), zeros, zeros, seq_ids=np.zeros(1, np.int64))


@jax.jit
def _gather_slots(k: jax.Array, v: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
  """K/V of flat slots: pages `[L, H, N, bs, D]`, `slots: i32[T]` -> `[L, H, T, D]`."""
  l, h, n, bs, d = k.shape
  return (k.reshape(l, h, n * bs, d)[:, :, slots], v.reshape(l, h, n * bs, d)[:, :, slots])


# ----------------------------------------------------------------------------- read
@dataclasses.dataclass(frozen=True)
class _SavedCache:
  """A validated file: the tree (host arrays) and K/V as the pool dtype."""

  pool: dict[str, Any]
  namespaces: list[Hashable]
  node_namespace: np.ndarray  # i32[N]
  node_parent: np.ndarray     # i64[N]
  cu_tokens: np.ndarray       # i64[N + 1]
  tokens: np.ndarray          # i32[T]
  node_recency: np.ndarray    # i64[N]
  node_pin_ttl: np.ndarray    # f64[N]
  k: np.ndarray               # [L, H, T, D] bits (unsigned int of the dtype's width)
  v: np.ndarray

  @property
  def num_nodes(self) -> int:
    return int(self.node_parent.shape[0])


def _read_bytes(path: str | os.PathLike) -> bytes:
  """The file's bytes; every failure is a typed `PersistError`."""
  try:
    where = os.fspath(path)
  except TypeError as e:
    raise InvalidArgument(f"path must be a str or os.PathLike, got {path!r}") from e
  try:
    with open(where, "rb") as f:
      return f.read()
  except FileNotFoundError as e:
    raise MissingFileError(e.errno, f"no prefix-cache file at {where!r}", where) from e
  except OSError as e:  # IsADirectoryError, PermissionError, EIO, ...
    raise UnreadableFileError(e.errno, f"cannot read {where!r} as a prefix-cache file: "
                              f"{e.strerror or e}", where) from e
  except ValueError as e:  # e.g. an embedded NUL byte in the path
    raise InvalidArgument(f"bad path {where!r}: {e}") from e


def _read(path: str | os.PathLike) -> _SavedCache:
  """Reads and validates the file; every failure is a typed `PersistError`.

  Whatever the archive reader or the parser raise on a damaged file becomes a
  `CorruptFileError` with the original as its cause.
  """
  raw = _read_bytes(path)
  try:
    return _parse(raw, os.fspath(path))
  except PersistError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise CorruptFileError(f"{os.fspath(path)!r} is not a readable prefix-cache archive "
                           f"(truncated or corrupted): {type(e).__name__}: {e}") from e


def _parse(raw: bytes, path: str) -> _SavedCache:
  """`_read` on the file's bytes."""
  try:
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
      names = set(z.files)
      missing = {"header", *_ARRAYS} - names
      if missing:
        raise CorruptFileError(f"{os.fspath(path)!r}: missing members {sorted(missing)}")
      header_bytes = z["header"]
      arrays = {name: z[name] for name in _ARRAYS}
  except PersistError:
    raise
  except (zipfile.BadZipFile, zlib.error, ValueError, OSError, EOFError, KeyError,
          UnicodeDecodeError, RuntimeError, NotImplementedError) as e:
    raise CorruptFileError(f"{os.fspath(path)!r} is not a readable prefix-cache archive "
                           f"(truncated or corrupted): {e}") from e
  try:
    if header_bytes.dtype != np.uint8 or header_bytes.ndim != 1:
      raise ValueError("header is not a uint8 vector")
    header = json.loads(header_bytes.tobytes().decode())
    if not isinstance(header, dict):
      raise ValueError("header is not a JSON object")
  except (ValueError, RecursionError) as e:
    raise CorruptFileError(f"{os.fspath(path)!r}: unreadable header: {e}") from e
  if header.get("format") != FORMAT_NAME:
    raise UnsupportedVersionError(f"{os.fspath(path)!r}: format {header.get('format')!r} is "
                                  f"not {FORMAT_NAME!r}")
  if header.get("version") != FORMAT_VERSION:
    raise UnsupportedVersionError(f"{os.fspath(path)!r}: format version "
                                  f"{header.get('version')!r}; this library reads version "
                                  f"{FORMAT_VERSION}")
  if header.get("checksum") != _checksum(header, arrays):
    raise CorruptFileError(f"{os.fspath(path)!r}: checksum mismatch (the file was modified "
                           f"or damaged)")
  return _validate(header, arrays, os.fspath(path))


def _validate(header: dict[str, Any], a: dict[str, np.ndarray], where: str) -> _SavedCache:
  """Shapes, dtypes and tree structure of a checksummed file."""
  def bad(msg: str) -> CorruptFileError:
    return CorruptFileError(f"{where}: {msg}")

  pool = header.get("pool")
  if not isinstance(pool, dict) or any(key not in pool for key in (*_GEOMETRY, "block_size")):
    raise bad("header lacks the pool geometry")
  ns_entries = header.get("namespaces")
  if not isinstance(ns_entries, list):
    raise bad("header lacks the namespace list")
  namespaces = [_decode_namespace(e) for e in ns_entries]
  if len(set(namespaces)) != len(namespaces):
    raise bad("repeated namespaces")
  n, t = header.get("num_nodes"), header.get("num_tokens")
  want = {"node_namespace": (np.int32, (n,)), "node_parent": (np.int64, (n,)),
          "cu_tokens": (np.int64, (n + 1,) if isinstance(n, int) else None),
          "tokens": (np.int32, (t,)), "node_recency": (np.int64, (n,)),
          "node_pin_ttl": (np.float64, (n,))}
  for name, (dtype, shape) in want.items():
    if a[name].dtype != dtype or a[name].shape != shape:
      raise bad(f"member {name} is {a[name].dtype}{a[name].shape}, expected "
                f"{np.dtype(dtype)}{shape}")
  try:
    itemsize = jnp.dtype(pool["dtype"]).itemsize
    kv_shape = (int(pool["num_layers"]), int(pool["num_kv_heads"]), t, int(pool["head_dim"]))
  except (TypeError, ValueError) as e:
    raise bad(f"bad pool geometry {pool!r}: {e}") from e
  for name in ("k", "v"):
    if a[name].dtype != _BITS_DTYPES.get(itemsize) or a[name].shape != kv_shape:
      raise bad(f"member {name} is {a[name].dtype}{a[name].shape}, expected "
                f"{np.dtype(_BITS_DTYPES.get(itemsize, np.uint8))}{kv_shape}")
  parent, node_ns, cu = a["node_parent"], a["node_namespace"], a["cu_tokens"]
  idx = np.arange(n)
  if ((parent < -1) | (parent >= idx)).any():
    raise bad("a node's parent does not precede it")
  if ((node_ns < 0) | (node_ns >= len(namespaces))).any():
    raise bad("a node names an unknown namespace")
  has_parent = parent >= 0
  if (node_ns[has_parent] != node_ns[parent[has_parent]]).any():
    raise bad("a node's namespace differs from its parent's")
  if n and (cu[0] != 0 or cu[-1] != t or (np.diff(cu) < 1).any()):
    raise bad("node token spans are not consecutive non-empty ranges of the stream")
  first = a["tokens"][cu[:-1]] if n else np.zeros((0,), np.int32)
  keys = set(zip(parent.tolist(), node_ns.tolist(), first.tolist()))
  if len(keys) != n:
    raise bad("two children of one node start with the same token")
  if np.isnan(a["node_pin_ttl"]).any() or (a["node_pin_ttl"] < 0).any():
    raise bad("pin TTLs must be >= 0")
  if n and sorted(a["node_recency"].tolist()) != list(range(n)):
    raise bad("node_recency is not a permutation")
  return _SavedCache(pool=pool, namespaces=namespaces, **a)


# ----------------------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where each token of the stream goes, in placeholder blocks 0..B-1: per node its
  segments `i32[s, 3]`; per block its used slots `fill`, the stream index of each
  slot's token (`block_tokens`) and the tree's segments on it (`tree_refs`).
  """

  node_segments: list[np.ndarray]
  fill: np.ndarray
  block_tokens: list[np.ndarray]
  tree_refs: np.ndarray

  @property
  def num_blocks(self) -> int:
    return int(self.fill.shape[0])


def _plan_layout(cu_tokens: np.ndarray, block_size: int,
                 groups: np.ndarray | None = None) -> _Layout:
  """Whole blocks per node plus best-fit placement of each node's short tail, among
  the blocks of its group (`groups[i]`, node i's namespace: tenants never share a
  block; None: one group)."""
  bs = block_size
  fill: list[int] = []
  block_tokens: list[list[np.ndarray]] = []
  rooms: dict[int, list[list[int]]] = {}  # group -> room -> heap of block ids
  node_segments = []
  for i in range(cu_tokens.shape[0] - 1):
    open_by_room = rooms.setdefault(0 if groups is None else int(groups[i]),
                                    [[] for _ in range(bs)])
    begin, end = int(cu_tokens[i]), int(cu_tokens[i + 1])
    q, r = divmod(end - begin, bs)
    segs = []
    for c in range(q):
      fill.append(bs)
      block_tokens.append([np.arange(begin + c * bs, begin + (c + 1) * bs)])
      segs.append((len(fill) - 1, 0, bs))
    if r:
      room = next((m for m in range(r, bs) if open_by_room[m]), None)
      if room is None:
        fill.append(0)
        block_tokens.append([])
        j = len(fill) - 1
      else:
        j = heapq.heappop(open_by_room[room])
      segs.append((j, fill[j], r))
      block_tokens[j].append(np.arange(begin + q * bs, end))
      fill[j] += r
      if fill[j] < bs:
        heapq.heappush(open_by_room[bs - fill[j]], j)
    node_segments.append(np.asarray(segs, np.int32).reshape(-1, 3))
  all_blocks = (np.concatenate([s[:, 0] for s in node_segments]) if node_segments
                else np.zeros((0,), np.int32))
  return _Layout(node_segments=node_segments, fill=np.asarray(fill, np.int64),
                 block_tokens=[np.concatenate(p).astype(np.int64) for p in block_tokens],
                 tree_refs=np.bincount(all_blocks, minlength=len(fill)).astype(np.int64))


def _build_tree(cache: PrefixCache, saved: _SavedCache,
                node_segments: list[np.ndarray]) -> RefDeltas:
  """Inserts the saved tree into `cache` on `node_segments`; returns the tree's references.

  Leaves go in LRU order, each with its full path; inner node boundaries are then
  recreated by splits on segment boundaries (no segment cut).
  """
  n = saved.num_nodes
  parent, cu = saved.node_parent, saved.cu_tokens
  paths: list[np.ndarray] = []
  path_segs: list[np.ndarray] = []
  for i in range(n):
    key = saved.tokens[cu[i]:cu[i + 1]]
    p = int(parent[i])
    paths.append(key if p < 0 else np.concatenate([paths[p], key]))
    path_segs.append(node_segments[i] if p < 0 else
                     np.concatenate([path_segs[p], node_segments[i]]))
  is_parent = np.zeros((n,), bool)
  is_parent[parent[parent >= 0]] = True
  deltas = RefDeltas.empty()
  for i in sorted(np.flatnonzero(~is_parent).tolist(), key=lambda i: saved.node_recency[i]):
    ns = saved.namespaces[saved.node_namespace[i]]
    deltas = deltas + cache.insert(ns, paths[i], path_segs[i]).ref_deltas
  for i in np.flatnonzero(is_parent).tolist():
    ns = saved.namespaces[saved.node_namespace[i]]
    m = cache.tree.match_prefix(ns, paths[i], now=0.0, record=False)
    if m.length != paths[i].shape[0]:
      raise CorruptFileError(f"node {i}'s path is not in the rebuilt tree")
    if m.last_offset < cache.tree.node(m.path[-1]).num_tokens:
      deltas = deltas + cache.split(m.path[-1], m.last_offset)[1]
  for i in np.flatnonzero(saved.node_pin_ttl > 0).tolist():
    cache.pin(saved.namespaces[saved.node_namespace[i]], paths[i],
              float(saved.node_pin_ttl[i]))
  return deltas


# ----------------------------------------------------------------------------- load
def load_prefix_cache(path: str | os.PathLike, pool: BlockPool,
                      cache: PrefixCache | None = None, *,
                      mix_namespaces: bool = False) -> PrefixCache:
  """Restores a saved prefix cache into `pool`; returns the cache.

  The geometry (layers, kv heads, head_dim, dtype) must match the saving pool's; the
  block count, block size, rows and regions may differ. `pool` needs the layout's
  blocks free (base-region blocks count) and one free row. `cache`: an empty
  `PrefixCache` with the pool's block size (default a new one). `mix_namespaces`:
  let different namespaces' tails share a block (see `CachedPool`).

  Raises:
    MissingFileError, UnreadableFileError: no file, or unreadable (`OSError`s too).
    CorruptFileError: damaged file, checksum mismatch, malformed tree.
    UnsupportedVersionError: another format or version.
    ConfigMismatchError: the geometry differs from the pool's.
    InvalidArgument: `cache` is not empty or has another block size.
    PoolExhausted: too few free blocks (`"no_free_block"`) or rows (`"no_free_row"`).
    On every error the pool and `cache` are unchanged.
  """
  config = pool.config
  bs = config.block_size
  remove_stale_temps(path)
  saved = _read(path)
  theirs = {key: saved.pool[key] for key in _GEOMETRY}
  ours = {key: getattr(config, key) for key in _GEOMETRY}
  if theirs != ours:
    diff = ", ".join(f"{key} {theirs[key]!r} (file) != {ours[key]!r} (pool)"
                     for key in _GEOMETRY if theirs[key] != ours[key])
    raise ConfigMismatchError(f"{os.fspath(path)!r} does not fit this pool: {diff}")
  if cache is not None:
    if cache.block_size != bs:
      raise InvalidArgument(f"cache block_size {cache.block_size} != pool block_size {bs}")
    if len(cache.tree):
      raise InvalidArgument(f"load_prefix_cache needs an empty cache; it holds "
                            f"{len(cache.tree)} nodes")

  layout = _plan_layout(saved.cu_tokens, bs, None if mix_namespaces else saved.node_namespace)
  # Dry run on host with the virtual block ids: validates the tree before the pool moves.
  staging = PrefixCache(block_size=bs)
  try:
    staged_refs = _build_tree(staging, saved, layout.node_segments)
  except Exception as e:  # pylint: disable=broad-except
    # Only the private staging cache saw the tree: nothing outside changed.
    raise CorruptFileError(f"{os.fspath(path)!r}: the saved tree cannot be rebuilt: {e}") from e
  expected = RefDeltas.from_pairs(np.arange(layout.num_blocks), layout.tree_refs)
  if (len(staging.tree) != saved.num_nodes
      or not np.array_equal(staged_refs.block_ids, expected.block_ids)
      or not np.array_equal(staged_refs.deltas, expected.deltas)):
    raise CorruptFileError(f"{os.fspath(path)!r}: the rebuilt tree differs from the saved one")

  free_base = _free_base_blocks(pool)
  if layout.num_blocks > pool.num_free_blocks + free_base:
    raise PoolExhausted(f"the saved cache needs {layout.num_blocks} blocks of "
                        f"{bs} tokens; the pool has {pool.num_free_blocks} free "
                        f"(+ {free_base} free in its base region)", reason="no_free_block")
  num_free_rows = config.max_seqs - int(pool.host.active.sum())
  if layout.num_blocks and num_free_rows < 1:
    raise PoolExhausted("loading needs one free sequence row", reason="no_free_row")

  physical = _write_blocks(pool, saved, layout, min(num_free_rows, _MAX_LOAD_BATCH))
  if cache is None:
    remap = np.arange(max(config.num_blocks, layout.num_blocks), dtype=np.int64)
    remap[:layout.num_blocks] = physical
    staging.apply_remap(remap)
    return staging
  _build_tree(cache, saved, [np.column_stack([physical[s[:, 0]], s[:, 1:]]).astype(np.int32)
                             for s in layout.node_segments])
  return cache


def _free_base_blocks(pool: BlockPool) -> int:
  """Free blocks of the pool's base region (promotion's destinations)."""
  h = pool.host
  return int(((h.region == REGION_BASE) & (h.ref_count == 0)).sum())


def _write_blocks(pool: BlockPool, saved: _SavedCache, layout: _Layout,
                  max_batch: int) -> np.ndarray:
  """Allocates the layout's blocks, writes their K/V and applies the tree's references;
  returns `i64[B]`, the physical block of each virtual block.

  Temporary sequences reserve the blocks (one per run of whole blocks ended by a
  partial one), so the allocator marks exactly the used slots. On failure the
  references taken so far are dropped again and the error propagates.
  """
  config = pool.config
  bs = config.block_size
  groups: list[list[int]] = []
  current: list[int] = []
  for j in range(layout.num_blocks):
    current.append(j)
    if layout.fill[j] < bs or len(current) == config.max_segments:
      groups.append(current)
      current = []
  if current:
    groups.append(current)
  if not groups:
    return np.zeros((0,), np.int64)
  dtype = config.jnp_dtype
  k_all, v_all = saved.k.view(dtype), saved.v.view(dtype)
  physical = np.full((layout.num_blocks,), -1, np.int64)
  # Writes padded to `max_batch` rows of a power-of-two width (slot -1 is skipped):
  # few shapes whatever the file.
  most = max(int(layout.fill[g].sum()) for g in groups)
  width = 1 << max(most - 1, 0).bit_length()  # what reserve_tokens pads to, at most
  open_seqs: list[int] = []
  applied: list[tuple[np.ndarray, np.ndarray]] = []
  try:
    g0 = 0
    while g0 < len(groups):
      batch = groups[g0:g0 + max_batch]
      need = sum(len(g) for g in batch)
      if need > pool.num_free_blocks:
        # The dynamic region is short (a cache saved with promoted blocks): move loaded
        # blocks into free base-pool blocks, then take the groups that fit.
        remap = pool.promote(1, max_moves=need - pool.num_free_blocks)
        physical = np.where(physical >= 0, remap[np.maximum(physical, 0)], physical)
        applied = [(remap[ids], refs) for ids, refs in applied]
        fit, room = 0, pool.num_free_blocks
        while fit < len(batch) and len(batch[fit]) <= room:
          room -= len(batch[fit])
          fit += 1
        if fit < len(batch) and room > 0:
          # Split the next group after `room` blocks: all but a group's last block are
          # whole, so its first part loads as a sequence of its own.
          g = groups[g0 + fit]
          groups[g0 + fit:g0 + fit + 1] = [g[:room], g[room:]]
          fit += 1
        if fit == 0:
          raise PoolExhausted("no free dynamic block left to load into and no loaded "
                              "block to move into the base region", reason="no_free_block")
        batch = groups[g0:g0 + fit]
      g0 += len(batch)
      src = [np.concatenate([layout.block_tokens[j] for j in g]) for g in batch]
      for _ in batch:
        open_seqs.append(pool.open_sequence())
      reserved = np.asarray(pool.reserve_tokens(open_seqs, [s.shape[0] for s in src]))
      slot_idx = np.full((_MAX_LOAD_BATCH, width), -1, np.int32)
      slot_idx[:len(batch), :reserved.shape[1]] = reserved
      src_idx = np.zeros((_MAX_LOAD_BATCH, width), np.int64)
      for r, (g, s) in enumerate(zip(batch, src)):
        src_idx[r, :s.shape[0]] = s
        physical[g] = slot_idx[r, np.arange(len(g)) * bs] // bs
      used = slot_idx.reshape(-1) >= 0  # every layer, the batch's tokens, in chunks
      flat = src_idx.reshape(-1)[used]
      writers = np.repeat(np.asarray(open_seqs + [0] * (_MAX_LOAD_BATCH - len(open_seqs)),
                                     np.int64), width)[used]  # row r's slots: open_seqs[r]
      write_tokens(pool, slot_idx.reshape(-1)[used], k_all[:, :, flat], v_all[:, :, flat],
                   writers)
      blocks = np.concatenate([np.asarray(g) for g in batch])
      ids, refs = physical[blocks], layout.tree_refs[blocks]
      pool.apply_ref_deltas(ids, refs)
      applied.append((ids, refs))
      pool.release(open_seqs)
      open_seqs = []
  except BaseException:
    if open_seqs:
      live = set(pool.active_sequences().tolist())
      pool.release([s for s in open_seqs if s in live])
    for ids, refs in applied:
      pool.apply_ref_deltas(ids, -refs)
    raise
  return physical
