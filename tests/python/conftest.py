"""Session-wide checks: the ISA level the tests run under is the one FANTAI_CPU_ISA asked for.

`make test` runs the numerics tests again under each lower level this CPU can run; a level that
silently fell back (a typo, a CPU that lacks it) would make that run test the native kernels twice.
"""

from __future__ import annotations

import os

import pytest


def pytest_report_header(config: pytest.Config) -> str:
    from fantai import _C

    return f"fantai cpu isa: {_C.cpu_isa()} (runnable: {', '.join(_C.cpu_isa_levels())})"


def pytest_sessionstart(session: pytest.Session) -> None:
    want = os.environ.get("FANTAI_CPU_ISA")
    if want:
        from fantai import _C

        if _C.cpu_isa() != want:
            raise pytest.UsageError(f"FANTAI_CPU_ISA={want} but the core runs {_C.cpu_isa()} "
                                    f"(this CPU can run: {', '.join(_C.cpu_isa_levels())})")
