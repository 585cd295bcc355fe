"""An engine with a forward thread that runs scoped nodes and a plan thread that only reads.

torch's float32 precision flags are process-wide. fp32scope lets one thread at a time be
inside flag-changing scopes (the engine's forward thread); any thread may read the flags.
Here the plan thread reads the precision while the forward thread is inside a node's scope
(it sees that node's precision: the flags are the process's), then tries a scope of its
own, which raises ``Fp32ScopeError`` naming both threads, before changing anything.
"""

from __future__ import annotations

import threading

import torch

from fp32scope import (
    Fp32Precision,
    Fp32ScopedModule,
    Fp32ScopeError,
    current_fp32_precision,
    fp32_precision_scope,
    set_process_default,
)

TIMEOUT_S = 30.0


def wait_for(event: threading.Event, what: str) -> None:
    if not event.wait(TIMEOUT_S):
        msg = f"timed out waiting for {what}"
        raise RuntimeError(msg)


class Gate(torch.nn.Module):
    """A node that, in the middle of its forward, lets the plan thread look, and waits for it."""

    def __init__(self, inside: threading.Event, plan_done: threading.Event) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.inside = inside
        self.plan_done = plan_done

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inside.set()
        wait_for(self.plan_done, "the plan thread to finish")
        out: torch.Tensor = self.linear(x)
        return out


def main() -> None:
    set_process_default(Fp32Precision("high", cudnn_allow_tf32=True))
    print(f"process default:                {current_fp32_precision()}")
    inside = threading.Event()
    plan_done = threading.Event()
    node = Fp32ScopedModule(Gate(inside, plan_done), Fp32Precision("highest", cudnn_allow_tf32=False), name="gate")
    errors: list[BaseException] = []

    encoder = torch.nn.Linear(8, 8)  # declares nothing: runs under the process default

    def forward_loop() -> None:
        try:
            with torch.no_grad():
                for step in range(3):  # the node waits for the plan thread in the first step only
                    node(encoder(torch.randn(4, 8)))
                    print(f"forward thread, after step {step}:   {current_fp32_precision()}")
        except Exception as exc:  # noqa: BLE001  (re-raised by the main thread)
            errors.append(exc)

    def plan() -> None:
        try:
            wait_for(inside, "the forward thread to enter the node")
            # Reading is fine from any thread; it shows the forward thread's node precision.
            print(f"plan thread reads:              {current_fp32_precision()}")
            try:
                with fp32_precision_scope(Fp32Precision("medium")):
                    print("plan thread: inside its own scope (must not happen)")
            except Fp32ScopeError as error:
                print(f"plan thread got Fp32ScopeError: {error}")
        except Exception as exc:  # noqa: BLE001  (re-raised by the main thread)
            errors.append(exc)
        finally:
            plan_done.set()

    threads = [
        threading.Thread(target=forward_loop, name="forward"),
        threading.Thread(target=plan, name="plan"),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    if errors:
        raise errors[0]
    # With the forward thread done, any thread may enter a scope again.
    with fp32_precision_scope(Fp32Precision("medium")):
        print(f"main thread, in its own scope:  {current_fp32_precision()}")
    print(f"process default is back:        {current_fp32_precision()}")


if __name__ == "__main__":
    main()
