"""The Python side of ``csrc/step_abi.h``: the structs and enums the fused kernels read, by name.

Structs are ``ctypes`` structures laid out as C lays out the header's (natural alignment, same field order),
built with :func:`build` (every field named, none left to a default) and handed to the ops as bytes
(:func:`as_tensor`). Enums are ``IntEnum``\\s whose members are the header's enumerators in upper snake case
(``ErrorCode::kBadIdWarn`` is ``ErrorCode.BAD_ID_WARN``). :func:`describe` renders this mirror in the text
the header's ``describe_step_abi()`` produces; :func:`check_extension` compares the two when the extension
loads, so a contract that drifted stops the first step instead of corrupting it.
"""

import ctypes
import re
from enum import IntEnum
from typing import Any, Iterator, List, Sequence, Type, TypeVar

import torch

from torchrec_pgas.types import PgasError

MAX_WORLD = 64
MAX_SLOTS = 4
ABORT_RANK_BITS = 7  # abort word = (step epoch << ABORT_RANK_BITS) | (aborting rank + 1)


class PadWord(IntEnum):
    ABORT = 0
    ABORT_MESSAGE = 1
    HEADER_WORDS = 32


class SignalGroup(IntEnum):
    INDEX_SIGNALS = 0
    OUTPUT_SIGNALS = 1
    GRAD_SIGNALS = 2
    RELEASE_SIGNALS = 3
    SIGNAL_GROUPS = 4


class WeightDtype(IntEnum):
    F32 = 0
    F16 = 1


class PoolingMode(IntEnum):
    SUM = 0
    MEAN_BY_REQUESTER = 1
    MEAN_BY_OWNER = 2


class BoundsMode(IntEnum):
    FATAL = 0
    WARNING = 1
    IGNORE = 2


class ErrorCode(IntEnum):
    NONE = 0
    BAD_ID = 1
    BATCH_MISMATCH = 2
    TIMEOUT = 3
    PEER_ABORT = 4
    CORRUPT = 5
    BAD_ID_WARN = 6


class DeviceStatus(IntEnum):
    OK = 0
    TIMEOUT = 1
    PEER_ABORT = 2


class StateWord(IntEnum):
    CTR_INDEX = 0
    CTR_LOOKUP = 1
    TILE_CLAIMS = 2
    DONE_INDEX = 3
    DONE_LOOKUP = 4
    DONE_COMBINE = 5
    CTR_COMBINE = 6
    DONE_GRAD = 7
    TRACE_BUF = 12
    TRACE_STEP = 13
    TRACE_CAP = 14
    TRACE_BYTES = 15
    DONE_SRC = 16
    BAG_CLAIMS = 16 + MAX_WORLD
    ERR_RECORDS = 16 + 2 * MAX_WORLD
    STEP_FAILED = ERR_RECORDS + 4 * MAX_SLOTS
    STEP_DEADLINE = STEP_FAILED + MAX_SLOTS
    DEADLINE_AT = STEP_DEADLINE + MAX_SLOTS
    STATE_WORDS = DEADLINE_AT + 1


class Optimizer(IntEnum):
    SGD = 0
    ROWWISE_ADAGRAD = 1
    ADAM = 2


class WeightDecay(IntEnum):
    NONE = 0
    L2 = 1
    DECOUPLE = 2


ENUMS: Sequence[Type[IntEnum]] = (PadWord, SignalGroup, WeightDtype, PoolingMode, BoundsMode, ErrorCode,
                                  DeviceStatus, StateWord, Optimizer, WeightDecay)

_i64, _i32, _f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class FeatureDesc(ctypes.Structure):
    """One per feature of the sharding, in sharding feature order (see the header for each field)."""

    _fields_ = [
        ("weights", _i64), ("local_rows", _i64), ("block", _i64), ("hash_size", _i64), ("dim", _i64),
        ("out_col", _i64), ("weight_dtype", _i64), ("pooling", _i64), ("block_magic", _i64),
        ("block_shift", _i64), ("owner_base", _i64), ("owner_count", _i64), ("input_feature", _i64),
    ]


class StepConfig(ctypes.Structure):
    """The symmetric buffer's layout, its capacities and this rank's role (``StepLayout.config``)."""

    _fields_ = [
        ("index_block_bytes", _i64), ("output_region_off", _i64), ("output_block_bytes", _i64),
        ("grad_region_off", _i64),
        ("offsets_off", _i64), ("lengths_off", _i64), ("ids_off", _i64), ("weights_off", _i64),
        ("num_slots", _i64), ("max_batch", _i64), ("capacity", _i64), ("dim_sum", _i64),
        ("num_features", _i64), ("timeout_ns", _i64),
        ("rank", _i32), ("world", _i32), ("weighted", _i32), ("bounds_mode", _i32), ("id_bytes", _i32),
        ("lookup_f_lo", _i32), ("lookup_f_hi", _i32), ("variable_batch", _i32), ("trace", _i32),
    ]


class ErrorRecord(ctypes.Structure):
    """A step's error record (code: ``ErrorCode``), as its combine publishes it to pinned memory (one per
    buffer slot)."""

    _fields_ = [("epoch", _i64), ("code", _i64), ("a", _i64), ("b", _i64), ("c", _i64)]


class OwnerFeatureDesc(ctypes.Structure):
    """One per feature of a TBE: its table and its first column in the pooled gradient."""

    _fields_ = [("table", _i64), ("grad_col", _i64)]


class OwnerHyper(ctypes.Structure):
    """An update's hyper-parameters (fp32), read on the device."""

    _fields_ = [("lr", _f32), ("eps", _f32), ("beta1", _f32), ("beta2", _f32), ("weight_decay", _f32),
                ("bias_correction1", _f32), ("bias_correction2", _f32), ("reserved", _f32)]


class KeptBagsConfig(ctypes.Structure):
    """Where an owner's kept bags lie in its buffer and which it reads (``kept_bags``; weights_off -1:
    unweighted)."""

    _fields_ = [(name, _i64) for name in ("index_block_bytes", "lengths_off", "offsets_off", "ids_off",
                                          "weights_off", "id_bytes", "max_batch", "features_per_block",
                                          "first_feature", "num_features", "world", "rows")]


class OwnerKeysConfig(ctypes.Structure):
    """What the host decides of the keys of one TBE's kept ids (``owner_keys``)."""

    _fields_ = [("first_bag", _i64), ("end_bag", _i64), ("stride", _i64), ("key_limit", _i64)]


class OwnerUpdateConfig(ctypes.Structure):
    """What the host decides of an owner update (optimizer: ``Optimizer``, weight_decay_mode: ``WeightDecay``)."""

    _fields_ = [("optimizer", _i64), ("weight_decay_mode", _i64), ("mean", _i64), ("weighted", _i64),
                ("batch", _i64)]


STRUCTS: Sequence[Type[ctypes.Structure]] = (FeatureDesc, StepConfig, ErrorRecord, OwnerFeatureDesc, OwnerHyper,
                                             KeptBagsConfig, OwnerKeysConfig, OwnerUpdateConfig)
ERROR_RECORD_WORDS = ctypes.sizeof(ErrorRecord) // 8

S = TypeVar("S", bound=ctypes.Structure)


def build(struct: Type[S], **fields: float) -> S:
    """``struct`` with every field given by name: a field left out or misspelt raises."""
    names = [name for name, _ in struct._fields_]
    missing, unknown = set(names) - set(fields), set(fields) - set(names)
    if missing or unknown:
        raise PgasError(f"{struct.__name__}: fields {sorted(missing)} missing, {sorted(unknown)} unknown")
    kinds = dict(struct._fields_)
    return struct(**{name: float(value) if kinds[name] is _f32 else int(value) for name, value in fields.items()})


def as_tensor(value: Any) -> torch.Tensor:
    """The bytes of a struct (or ctypes array of structs) as a CPU uint8 tensor the ops copy from."""
    return torch.frombuffer(bytearray(bytes(value)), dtype=torch.uint8)


def as_words(structs: Sequence[ctypes.Structure], struct: Type[ctypes.Structure]) -> torch.Tensor:
    """``struct``s (8-byte fields) as one int64 ``[len, words]`` tensor: a device table the kernels index."""
    words = ctypes.sizeof(struct) // 8
    raw = bytearray(b"".join(bytes(s) for s in structs))
    return torch.frombuffer(raw, dtype=torch.int64).view(-1, words) if raw else torch.zeros(0, words, dtype=torch.int64)


def cxx_name(member: str) -> str:
    """``BAD_ID_WARN`` -> ``kBadIdWarn`` (the header's spelling)."""
    return "k" + "".join(part.capitalize() for part in member.split("_"))


def _lines() -> Iterator[str]:
    yield f"const kMaxWorld {MAX_WORLD}"
    yield f"const kMaxSlots {MAX_SLOTS}"
    yield f"const kAbortRankBits {ABORT_RANK_BITS}"
    for enum in ENUMS:
        for member in enum:
            yield f"enum {enum.__name__} {cxx_name(member.name)} {int(member)}"
    for struct in STRUCTS:
        yield f"struct {struct.__name__} {ctypes.sizeof(struct)}"
        for name, ctype in struct._fields_:
            yield f"field {struct.__name__} {name} {getattr(struct, name).offset} {ctypes.sizeof(ctype)}"


def describe() -> str:
    """This mirror in the text of the header's ``describe_step_abi()``."""
    return "".join(line + "\n" for line in _lines())


def check_against(header_description: str, where: str) -> None:
    """Raise naming every line on which ``where``'s description and this mirror differ."""
    theirs, ours = header_description.splitlines(), describe().splitlines()
    only_theirs = [line for line in theirs if line not in ours]
    only_ours = [line for line in ours if line not in theirs]
    if only_theirs or only_ours or theirs != ours:
        raise PgasError(
            f"torchrec_pgas.step_abi does not match {where}: only there {only_theirs}, only here {only_ours}"
            + ("" if only_theirs or only_ours else " (same lines, another order)")
            + "; rebuild the extension (pip install --no-build-isolation .) from this checkout"
        )


def header_enumerators(header_text: str) -> List[str]:
    """``TYPE NAME`` of every enumerator the header's enum bodies declare (for the CPU check that
    ``describe_step_abi`` lists them all)."""
    out = []
    for enum, body in re.findall(r"enum (?:class )?(\w+) : \w+ \{(.*?)\};", header_text, flags=re.S):
        out += [f"{enum} {name}" for name in re.findall(r"\b(k[A-Z]\w*)\s*=", body)]
    return out


_checked = False


def extension_description() -> str:
    """What the loaded extension's header describes (``describe_step_abi``)."""
    return bytes(torch.ops.torchrec_pgas.step_abi().numpy()).decode()


def check_extension() -> None:
    """Compare this mirror with the loaded extension's header, once per process."""
    global _checked
    if not _checked:
        check_against(extension_description(), "the built extension (csrc/step_abi.h)")
        _checked = True
