"""Threads: the flags are process-wide, so scopes on two threads must never interleave."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from fp32scope import (
    Fp32Precision,
    Fp32ScopeError,
    current_fp32_precision,
    fp32_precision_scope,
    set_process_default,
)
from fp32scope._flags import torch_flags as _flags


@contextmanager
def held_on_thread(precision: Fp32Precision, name: str = "forward") -> Iterator[threading.Thread]:
    """Run a thread that sits inside ``fp32_precision_scope(precision)`` until the block ends."""
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def forward() -> None:
        try:
            with fp32_precision_scope(precision):
                inside.set()
                release.wait(10)
        except BaseException as error:
            errors.append(error)
            inside.set()

    thread = threading.Thread(target=forward, name=name)
    thread.start()
    assert inside.wait(10)
    try:
        yield thread
    finally:
        release.set()
        thread.join(10)
    assert not errors


def run_on(name: str, fn: Callable[[], object]) -> BaseException | None:
    result: list[BaseException | None] = [None]

    def target() -> None:
        try:
            fn()
        except BaseException as error:
            result[0] = error

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join(10)
    return result[0]


@pytest.mark.parametrize(
    "other", [Fp32Precision("high", True), Fp32Precision("highest", False), Fp32Precision("medium")]
)
def test_a_second_thread_cannot_enter_and_touches_nothing(other: Fp32Precision) -> None:
    torch.set_float32_matmul_precision("high")
    with held_on_thread(Fp32Precision("highest", False)):
        readings, raw = _flags.read_all(), _flags.save_raw_state()
        error = run_on("plan", lambda: fp32_precision_scope(other).__enter__())
        assert isinstance(error, Fp32ScopeError)
        message = str(error)
        assert "'plan'" in message
        assert "'forward'" in message
        assert "process-wide" in message
        # The forward thread's flags are as it set them.
        assert _flags.read_all() == readings
        assert _flags.save_raw_state() == raw


def test_refused_also_when_the_flags_already_match() -> None:
    # The other thread's exit would change them under this one.
    with held_on_thread(Fp32Precision("highest", False)):
        error = run_on("plan", lambda: fp32_precision_scope(Fp32Precision("highest", False)).__enter__())
        assert isinstance(error, Fp32ScopeError)


def test_reads_and_noop_scopes_are_fine_on_any_thread() -> None:
    torch.set_float32_matmul_precision("high")
    with held_on_thread(Fp32Precision("highest", False)):
        seen: list[Fp32Precision] = []

        def read() -> None:
            seen.append(current_fp32_precision())
            with fp32_precision_scope(None), fp32_precision_scope(Fp32Precision()):
                seen.append(current_fp32_precision())

        assert run_on("plan", read) is None
        assert seen == [Fp32Precision("highest", False)] * 2


def test_set_process_default_is_refused_while_any_scope_is_active() -> None:
    torch.set_float32_matmul_precision("high")
    with held_on_thread(Fp32Precision("highest", False)):
        raw = _flags.save_raw_state()
        error = run_on("main-ish", lambda: set_process_default(Fp32Precision("medium", True)))
        assert isinstance(error, Fp32ScopeError)
        assert "set_process_default" in str(error)
        assert "'forward'" in str(error)
        assert _flags.save_raw_state() == raw
    with fp32_precision_scope(Fp32Precision("highest")), pytest.raises(Fp32ScopeError, match="set_process_default"):
        set_process_default(Fp32Precision("medium"))


def test_the_next_thread_can_enter_after_the_first_exits() -> None:
    torch.set_float32_matmul_precision("high")
    with held_on_thread(Fp32Precision("highest", False)):
        pass
    seen: list[str] = []

    def scoped() -> None:
        with fp32_precision_scope(Fp32Precision("medium")):
            seen.append(torch.get_float32_matmul_precision())

    assert run_on("second", scoped) is None
    assert seen == ["medium"]
    assert torch.get_float32_matmul_precision() == "high"


def test_many_threads_hammering_never_interleave() -> None:
    torch.set_float32_matmul_precision("high")
    lock = threading.Lock()
    refused = [0]
    wrong: list[tuple[str, str]] = []

    def worker(precision: Fp32Precision) -> None:
        for _ in range(300):
            try:
                with fp32_precision_scope(precision):
                    got = torch.get_float32_matmul_precision()
                    if got != precision.matmul:
                        wrong.append((got, str(precision.matmul)))
            except Fp32ScopeError:
                with lock:
                    refused[0] += 1

    threads = [
        threading.Thread(target=worker, args=(Fp32Precision(m),)) for m in ("highest", "medium", "highest", "medium")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert wrong == []
    assert torch.get_float32_matmul_precision() == "high"


def test_the_conflict_error_names_the_wrapped_node() -> None:
    from fp32scope import with_fp32_precision

    @with_fp32_precision(Fp32Precision("medium"), name="decode")
    def decode() -> None:
        pass

    with held_on_thread(Fp32Precision("highest", False)):
        error = run_on("plan", decode)
    assert isinstance(error, Fp32ScopeError)
    assert "around 'decode'" in str(error)
