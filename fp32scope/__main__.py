"""Command line: ``python -m fp32scope demo``, ``doctor``, ``advise`` and ``--version``."""

from __future__ import annotations

import argparse
import platform
import warnings

__all__ = ["main"]


def _import_torch_quietly() -> None:
    # Where NumPy is not installed, ``import torch`` warns "Failed to initialize NumPy: No
    # module named 'numpy'". The demo and doctor use no NumPy, so on a first run (a fresh
    # venv has none) the warning only makes the user wonder what broke. Only this command
    # line ignores it, and only around the import: a library user still sees it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
        import torch  # noqa: F401


def _version() -> str:
    import torch

    import fp32scope

    return f"fp32scope {fp32scope.__version__} (torch {torch.__version__}, Python {platform.python_version()})"


def _parser() -> argparse.ArgumentParser:
    from fp32scope._tools import demo as _demo
    from fp32scope._tools import doctor as _doctor
    from fp32scope._tools.advise import cli as _advise

    parser = argparse.ArgumentParser(
        prog="python -m fp32scope",
        description=(
            "fp32scope: scoped float32 matmul and cuDNN precision for PyTorch. "
            "Run a small demo engine, or check this process's precision flags."
        ),
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,doctor,advise}")
    demo = commands.add_parser(
        "demo",
        help="run three torch.compile'd nodes on a forward thread, one of them in full float32",
        description=_demo.DESCRIPTION,
        epilog=_demo.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _demo.add_arguments(demo)
    demo.set_defaults(run=_demo.run)
    doctor = commands.add_parser(
        "doctor",
        help="check that torch's legacy and new precision APIs agree (exit status 1 when they do not)",
        description=_doctor.DESCRIPTION,
        epilog=_doctor.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _doctor.add_arguments(doctor)
    doctor.set_defaults(run=_doctor.run)
    advise = commands.add_parser(
        "advise",
        help="find which nodes of a model need full float32 for a tolerance (exit status 1 when none suffices)",
        description=_advise.DESCRIPTION,
        epilog=_advise.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _advise.add_arguments(advise)
    advise.set_defaults(run=_advise.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (default: ``sys.argv[1:]``); returns the exit status."""
    _import_torch_quietly()
    args = _parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
