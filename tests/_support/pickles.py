"""The fixture pickles: public objects pickled by fp32scope 0.1 (private module paths), and how they were made.

``python -m tests._support.pickles`` wrote ``tests/_support/pickles/`` once, with the code of
2026-12-02 (whose pickles name ``fp32scope._precision`` and ``fp32scope._proxy``). Never
write them again: they stand for the pickles and ``torch.save`` files users already have.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import cast

import torch

import fp32scope
from fp32scope import Fp32Precision, Fp32ScopedModule

HERE = Path(__file__).with_name("pickles")
OBJECTS = HERE / "public_objects_0.1.pkl"
MODEL = HERE / "scoped_model_0.1.pt"


def objects() -> dict[str, object]:
    """The public objects the fixture holds, as the code of today makes them (no tensors)."""
    precision = Fp32Precision("highest", cudnn_allow_tf32=False)
    event = fp32scope.Fp32TraceEvent("head", "forward", precision, precision, "MainThread")
    return {
        "precision": precision,
        "event": event,
        "trace": fp32scope.Fp32Trace([event]),
        "error": fp32scope.Fp32ScopeError("refused"),
    }


def model() -> torch.nn.Sequential:
    """A model with a scoped child, seeded: the fixture's ``torch.save`` file holds one made by this."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 3),
        cast(
            "torch.nn.Module",
            Fp32ScopedModule(torch.nn.Linear(3, 2), Fp32Precision("highest", cudnn_allow_tf32=False), name="head"),
        ),
    )


if __name__ == "__main__":
    HERE.mkdir(exist_ok=True)
    OBJECTS.write_bytes(pickle.dumps(objects(), protocol=2))
    torch.save(model(), MODEL)
