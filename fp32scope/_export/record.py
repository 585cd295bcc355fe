"""The precision record an exported artifact carries: plain string keys and values.

The same record goes into an AOTInductor package's metadata (``aot_inductor.metadata``,
which takes strings only, and which a C++ engine reads with
``AOTIModelPackageLoader::get_metadata()``) and, as JSON, into an extra file of a saved
``ExportedProgram``. Its values are the fields of :class:`~fp32scope.Fp32Precision` written
as Python writes them (``"highest"``, ``"bfx9"``, ``"True"``, ``"None"``), so that a reader in any
language can compare them with fixed strings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from fp32scope._flags.precision import MATMUL_WORDS, Fp32Precision, MatmulPrecision, check_matmul

__all__ = [
    "CUDNN_KEY",
    "EXTRA_FILE",
    "KEYS",
    "MATMUL_KEY",
    "RECORD_VERSION",
    "RESERVED_PREFIX",
    "VERSION_KEY",
    "check_not_reserved",
    "read_record",
    "read_record_file",
    "record",
    "record_file",
]

#: Every key and extra-file name that starts with this is fp32scope's.
RESERVED_PREFIX = "fp32scope"
VERSION_KEY = "fp32scope.version"
MATMUL_KEY = "fp32scope.matmul"
CUDNN_KEY = "fp32scope.cudnn_allow_tf32"
KEYS = (VERSION_KEY, MATMUL_KEY, CUDNN_KEY)
#: The version of the record's layout; a reader refuses a version it does not know.
RECORD_VERSION = "1"
#: The extra file of a saved ExportedProgram that holds the record (as a JSON object).
EXTRA_FILE = "fp32scope_precision.json"

_CUDNN_VALUES: dict[str, bool | None] = {"True": True, "False": False, "None": None}


def record(precision: Fp32Precision | None) -> dict[str, str]:
    """The record of a checked precision (None records both fields as ``"None"``)."""
    matmul, cudnn = (None, None) if precision is None else precision
    return {VERSION_KEY: RECORD_VERSION, MATMUL_KEY: str(matmul), CUDNN_KEY: str(cudnn)}


def record_file(precision: Fp32Precision | None) -> str:
    """The record as the text of the extra file (a JSON object of the same strings)."""
    return json.dumps(record(precision), sort_keys=True)


def read_record(metadata: Mapping[str, str], where: str) -> Fp32Precision | None:
    """The precision recorded in ``metadata``, or None when it holds no fp32scope key.

    A record with a missing key, an unknown version or a value outside the vocabulary
    raises :class:`ValueError` naming ``where``, the key and the value; so does a record of
    "bfx9" on a torch without it (naming the release that brings it).
    """
    if not any(key.startswith(RESERVED_PREFIX) for key in metadata):
        return None
    missing = [key for key in KEYS if key not in metadata]
    if missing:
        msg = f"The fp32scope precision record in {where} is incomplete: it lacks {', '.join(map(repr, missing))}."
        raise ValueError(msg)
    version = metadata[VERSION_KEY]
    if version != RECORD_VERSION:
        msg = (
            f"The fp32scope precision record in {where} has {VERSION_KEY}={version!r}; this fp32scope "
            f"reads version {RECORD_VERSION!r} only (a newer fp32scope wrote it?)."
        )
        raise ValueError(msg)
    matmul_text, cudnn_text = metadata[MATMUL_KEY], metadata[CUDNN_KEY]
    allowed = (*MATMUL_WORDS, "None")
    if matmul_text not in allowed:
        msg = (
            f"The fp32scope precision record in {where} has {MATMUL_KEY}={matmul_text!r}; "
            f"expected one of {', '.join(map(repr, allowed))}."
        )
        raise ValueError(msg)
    if cudnn_text not in _CUDNN_VALUES:
        msg = (
            f"The fp32scope precision record in {where} has {CUDNN_KEY}={cudnn_text!r}; "
            f"expected one of {', '.join(map(repr, _CUDNN_VALUES))}."
        )
        raise ValueError(msg)
    matmul: MatmulPrecision | None = None
    if matmul_text != "None":
        matmul = check_matmul(matmul_text, field=f"the {MATMUL_KEY} recorded in {where}")
    return Fp32Precision(matmul, _CUDNN_VALUES[cudnn_text])


def read_record_file(text: str, where: str) -> Fp32Precision | None:
    """The precision in the extra file's text (see :func:`record_file`)."""
    try:
        metadata = json.loads(text)
    except ValueError:
        metadata = None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        msg = f"The fp32scope precision record in {where} is not a JSON object of strings: {text[:200]!r}."
        raise ValueError(msg)
    found = read_record(metadata, where)
    if found is None:
        msg = f"The fp32scope precision record in {where} holds no fp32scope key: {text[:200]!r}."
        raise ValueError(msg)
    return found


def check_not_reserved(names: Mapping[object, object], argument: str) -> None:
    """Refuse a mapping whose keys are not all str, or that uses a name reserved for the record."""
    for name in names:
        if not isinstance(name, str):
            msg = f"{argument} must have str keys; got {name!r} of type {type(name).__name__}."
            raise TypeError(msg)
        if name.startswith(RESERVED_PREFIX):
            msg = (
                f"{argument} has the key {name!r}: names starting with {RESERVED_PREFIX!r} are reserved "
                "for fp32scope's precision record. Rename it."
            )
            raise ValueError(msg)
