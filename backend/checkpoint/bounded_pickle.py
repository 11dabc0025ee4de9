"""A bounded, restricted unpickler for the pickles a checkpoint holds (DCP ``.metadata``, the
``torch.save`` archives of non-tensor entries, tensor entries and RNG files).

Restricting globals (what ``find_class`` admits) stops code from running; it does not stop a
few hundred bytes from hanging or exhausting the process. Pickle's memo lets an object be referred
to again (``GET``), so 60 tuples that each hold the previous one twice describe a graph of 2**60
paths: hashing it (as a dict key) or printing it never ends, though the file is tiny. Here:

- A memo reference (``GET``) may fetch only an *atom* (str, bytes, number, bool, None, a class or
  function ``find_class`` admitted, a torch dtype / layout / memory format, an enum member, a
  placeholder of scan mode) or a flat tuple of atoms (``torch.Size``, DCP's ``planner_data``
  paths). Every container is thus used once and the object graph is a tree whose size the file
  bounds: hashing, printing and walking it take time linear in the file's size. A real DCP
  ``.metadata`` of an FSDP2 model and AdamW (2,419 references among 31 KB) passes.
- Dict keys and the arguments of ``REDUCE`` / ``NEWOBJ`` calls must be atoms or flat tuples of
  atoms, or keys a caller admits (DCP's ``MetadataIndex``, checked field by field before it is
  hashed); sets (whose construction hashes) and the legacy ``INST`` / ``OBJ`` / ``EXT`` opcodes are
  refused.
- At most ``max_objects`` containers and instances are built (memory: a 2-byte ``EMPTY_LIST`` +
  ``APPEND`` would otherwise cost 56 bytes each), and the finished tree is walked iteratively:
  deeper than ``max_depth`` is refused before anything recursive (a C-level hash, a repr, a
  ``pickle`` for a broadcast) can meet it.

Error messages name the file and the opcode or type; they never ``repr`` a loaded object.
"""

from __future__ import annotations

import enum
import io
import pickle
import pickletools
import types
from collections.abc import Callable
from typing import Any

import torch

from backend.errors import CheckpointError

_ATOMS = (str, bytes, int, float, bool, type(None), complex, torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that would need more than plain data to load, or whose pickle names a
    refused global, shares containers, nests too deep or builds too many objects."""


class UnreadablePickleError(CheckpointError):
    """A truncated or corrupt pickle (no sign of tampering: a damaged file)."""


class Placeholder:
    """What a global or persistent id becomes in scan mode (the structure is checked, nothing is built)."""

    def __call__(self, *args, **kwargs) -> Placeholder:
        return Placeholder()

    def __setstate__(self, state) -> None:
        pass


#: Shared flat tuples are at most this long (a torch.Size, a planner path): hashing or checking a
#: shared tuple again must cost little.
FLAT_TUPLE_MAX = 64


def is_atom(obj: Any) -> bool:
    """A value with no parts to recurse into (see the module docstring)."""
    return isinstance(obj, (*_ATOMS, enum.Enum, Placeholder, type, types.FunctionType, types.BuiltinFunctionType))


def is_flat_tuple(obj: Any, limit: int = FLAT_TUPLE_MAX) -> bool:
    return isinstance(obj, tuple) and len(obj) <= limit and all(is_atom(x) for x in obj)


def _shareable(obj: Any) -> bool:
    return is_atom(obj) or is_flat_tuple(obj)


_CONTAINER_OPS = {
    op.code.encode("latin-1")[0]
    for op in pickletools.opcodes
    if op.name
    in (
        "EMPTY_LIST",
        "EMPTY_DICT",
        "EMPTY_TUPLE",
        "LIST",
        "DICT",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "NEWOBJ",
        "REDUCE",
        "BINUNICODE",
        "BINUNICODE8",
        "BINBYTES",
        "BINBYTES8",
        "BYTEARRAY8",
        "SHORT_BINUNICODE",
        "SHORT_BINBYTES",
        "LONG4",
    )
}
_REFUSED_OPS = {
    op.code.encode("latin-1")[0]: op.name
    for op in pickletools.opcodes
    if op.name
    in (
        "INST",
        "OBJ",
        "EXT1",
        "EXT2",
        "EXT4",
        "EMPTY_SET",
        "ADDITEMS",
        "FROZENSET",
        "NEXT_BUFFER",
        "NEWOBJ_EX",
        "DUP",  # a second reference without the memo: never written by Python's pickler
    )
}


def _opcode(name: str) -> int:
    return getattr(pickle, name)[0]


class BoundedUnpickler(pickle._Unpickler):
    """``pickle``'s pure-Python unpickler with the bounds of the module docstring.

    ``allow(module, name)`` says which globals may be named; in ``scan`` mode an admitted global
    and every persistent id become ``Placeholder``s (the caller then loads the checked bytes with
    the library that owns the format). ``key_ok(obj)`` may admit more dict key types.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(
        self,
        file,
        *,
        where: str,
        allow: Callable[[str, str], bool],
        what: str = "the pickle",
        scan: bool = False,
        persistent: bool = False,
        key_ok: Callable[[Any], bool] | None = None,
        max_objects: int = 1_000_000,
        max_depth: int = 64,
    ):
        super().__init__(file)
        self._where, self._what, self._allow = where, what, allow
        self._scan, self._persistent = scan, persistent
        self._key_ok = key_ok or (lambda obj: False)
        self._objects, self._max_objects, self._max_depth = 0, max_objects, max_depth

    def refuse(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(f"{self._where}: refusing {self._what}: {what}")

    def find_class(self, module: str, name: str) -> Any:
        if not self._allow(module, name):
            raise self.refuse(f"GLOBAL {module}.{name} (a global this file never holds: it could run code)")
        return Placeholder() if self._scan else super().find_class(module, name)

    def persistent_load(self, pid):
        if not self._persistent:
            raise self.refuse("it holds a persistent id")
        return Placeholder()

    def load(self) -> Any:
        try:
            obj = super().load()
        except UnsafeCheckpointError:
            raise
        except (RecursionError, MemoryError) as e:
            raise self.refuse(f"{type(e).__name__} while unpickling") from None
        except Exception as e:  # truncated or corrupt: UnpicklingError, EOFError, struct.error...
            raise UnreadablePickleError(f"{self._where}: unreadable pickle ({type(e).__name__})") from None
        self._check_depth(obj)
        return obj

    def _check_depth(self, root: Any) -> None:
        """Depth at most ``max_depth``, and no container reached twice (the graph is a tree)."""
        stack, seen = [(root, 0)], set()
        while stack:
            obj, depth = stack.pop()
            if depth > self._max_depth:
                raise self.refuse(f"objects nested deeper than {self._max_depth}")
            if is_atom(obj) or is_flat_tuple(obj):
                continue
            if id(obj) in seen:
                raise self.refuse(f"a {type(obj).__name__} reached twice (a shared graph)")
            seen.add(id(obj))
            if isinstance(obj, list | tuple):
                stack.extend((x, depth + 1) for x in obj)
            elif isinstance(obj, dict):
                stack.extend((x, depth + 1) for kv in obj.items() for x in kv)
            elif hasattr(obj, "__dict__") and not is_atom(obj):
                stack.extend((x, depth + 1) for x in vars(obj).values())

    # ---- the checks, wrapped around pickle's own opcode handlers ---------------------------------

    def _count(self) -> None:
        self._objects += 1
        if self._objects > self._max_objects:
            raise self.refuse(f"more than {self._max_objects:,} objects")

    def _check_key(self, key: Any) -> None:
        if not (_shareable(key) or self._key_ok(key)):
            raise self.refuse(f"a dict key of type {type(key).__name__}")

    def _check_args(self, args: Any) -> None:
        if not isinstance(args, tuple) or not all(
            _shareable(a) or isinstance(a, list) and all(is_atom(x) for x in a) or isinstance(a, dict) and not a
            for a in args
        ):
            raise self.refuse("a call whose arguments are not plain values")


def _wrap(opname: str, before: Callable[[BoundedUnpickler], None] | None = None, after=None) -> None:
    code = _opcode(opname)
    inner = BoundedUnpickler.dispatch[code]

    def handler(self: BoundedUnpickler) -> None:
        if before is not None:
            before(self)
        inner(self)
        if after is not None:
            after(self)

    BoundedUnpickler.dispatch[code] = handler


def _check_get(self: BoundedUnpickler) -> None:
    if not _shareable(self.stack[-1]):
        raise self.refuse(
            f"a second reference to a {type(self.stack[-1]).__name__} (shared containers let a tiny file describe "
            f"an exponentially large graph)"
        )


def _check_setitem(self: BoundedUnpickler) -> None:
    self._check_key(self.stack[-2])


def _check_marked_keys(self: BoundedUnpickler) -> None:
    """SETITEMS / DICT: the items since the last MARK are ``self.stack``, keys at even offsets."""
    for key in self.stack[0::2]:
        self._check_key(key)


def _check_build(self: BoundedUnpickler) -> None:
    """BUILD sets state on the object below it: only on an instance, never on a class or function
    (that would change it for the whole process)."""
    target = self.stack[-2]
    if not isinstance(target, Placeholder) and (isinstance(target, type) or is_atom(target) or callable(target)):
        raise self.refuse(f"BUILD on a {type(target).__name__}")


def _check_int(self: BoundedUnpickler) -> None:
    value = self.stack[-1]
    if isinstance(value, int) and not -(1 << 64) <= value < 1 << 64:
        raise self.refuse(f"an integer of {value.bit_length()} bits")


def _check_reduce(self: BoundedUnpickler) -> None:
    self._check_args(self.stack[-1])


def _refuse(name: str) -> Callable[[BoundedUnpickler], None]:
    def handler(self: BoundedUnpickler) -> None:
        raise self.refuse(f"the opcode {name}")

    return handler


for _name in ("GET", "BINGET", "LONG_BINGET"):
    _wrap(_name, after=_check_get)
_wrap("SETITEM", before=_check_setitem)
_wrap("SETITEMS", before=_check_marked_keys)
_wrap("DICT", before=_check_marked_keys)
_wrap("REDUCE", before=_check_reduce)
_wrap("BUILD", before=_check_build)
for _name in ("LONG", "LONG1", "LONG4", "INT"):
    _wrap(_name, after=_check_int)
_wrap("NEWOBJ", before=_check_reduce)
for _code, _name in _REFUSED_OPS.items():
    BoundedUnpickler.dispatch[_code] = _refuse(_name)
for _code in _CONTAINER_OPS:
    _inner = BoundedUnpickler.dispatch[_code]

    def _counted(self: BoundedUnpickler, _inner=_inner) -> None:
        self._count()
        _inner(self)

    BoundedUnpickler.dispatch[_code] = _counted


def bounded_loads(data: bytes, **kwargs: Any) -> Any:
    """``BoundedUnpickler(io.BytesIO(data), **kwargs).load()``."""
    return BoundedUnpickler(io.BytesIO(data), **kwargs).load()
