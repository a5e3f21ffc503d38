"""pytest plugin of the GPU kit: the step's JUnit XML, rewritten after every test, so a killed step keeps its results.

    python -m pytest -p kit_pytest --kit-junit OUT/junit-STEP.xml NODE ...     (tools/gpu/ on PYTHONPATH)

Once collected, every test is in the file as not run (`<skipped type="kit.not_run">`); a test that starts is marked
interrupted (`<error type="kit.interrupted">`) until its report arrives, then passed, failed, skipped or error. pytest's
own --junitxml writes only when the session ends, which a step stopped by SIGKILL never reaches.
"""

from __future__ import annotations

import os
import time
import xml.etree.ElementTree as ET

NOT_RUN = ("skipped", "kit.not_run", "not run: the step's time limit ended before this test started")
INTERRUPTED = ("error", "kit.interrupted", "did not finish: the step was stopped during this test (its time limit)")


def pytest_addoption(parser) -> None:
    parser.addoption("--kit-junit", default=None, help="JUnit XML rewritten after every test (the GPU kit)")


def pytest_configure(config) -> None:
    path = config.getoption("--kit-junit")
    if path:
        config.pluginmanager.register(JUnitAsItGoes(path), "kit-junit")


class JUnitAsItGoes:
    def __init__(self, path: str):
        self.path = path
        self.cases: dict[str, dict] = {}
        self.started = time.time()
        self._write()

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.cases[report.nodeid or "collection"] = {"seconds": 0.0, "result": ("error", "collection",
                                                         _text(report))}  # fmt: skip
            self._write()

    def pytest_collection_finish(self, session) -> None:
        for item in session.items:
            self.cases.setdefault(item.nodeid, {"seconds": 0.0, "result": NOT_RUN})
        self._write()

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        self.cases[nodeid] = {"seconds": 0.0, "result": INTERRUPTED}
        self._write()

    def pytest_runtest_logreport(self, report) -> None:
        case = self.cases.setdefault(report.nodeid, {"seconds": 0.0, "result": INTERRUPTED})
        case["seconds"] += report.duration
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else _text(report)
            case["result"] = ("skipped", "pytest.skip", reason.removeprefix("Skipped: "))
        elif report.failed:
            kind = "failure" if report.when == "call" else "error"
            if case["result"] is INTERRUPTED or case["result"][0] not in ("failure", "error"):
                case["result"] = (kind, f"{report.when} failed", _text(report), _crash(report))
        elif report.when == "call":
            case["result"] = ("passed", "", "")
        if report.when == "teardown" or report.failed:
            self._write()

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        self._write()

    def _write(self) -> None:
        suite = ET.Element("testsuite", name="pytest", timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"))
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        for nodeid, case in self.cases.items():
            file, _, name = nodeid.partition("::")
            element = ET.SubElement(suite, "testcase", classname=file.removesuffix(".py").replace("/", "."),
                                    name=name or file, file=file, time=f"{case['seconds']:.3f}")  # fmt: skip
            tag, kind, text, *headline = case["result"]
            counts["tests"] += 1
            if tag != "passed":
                counts[{"failure": "failures", "error": "errors", "skipped": "skipped"}[tag]] += 1
                headline = headline[0] if headline else (text.splitlines() or [""])[0]
                child = ET.SubElement(element, tag, type=kind, message=headline[:300])
                child.text = text[-4000:]
        for key, value in counts.items():
            suite.set(key, str(value))
        suite.set("time", f"{time.time() - self.started:.1f}")
        tmp = f"{self.path}.tmp"
        root = ET.Element("testsuites")
        root.append(suite)
        ET.ElementTree(root).write(tmp, encoding="utf-8", xml_declaration=True)
        os.replace(tmp, self.path)


def _crash(report) -> str:
    """The line that says what failed (`AssertionError: ...`, `Failed: Timeout (>95.0s) from pytest-timeout.`)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    return (
        crash.message.splitlines()[0]
        if crash is not None and crash.message
        else (_text(report).splitlines() or [""])[-1]
    )


def _text(report) -> str:
    try:
        return str(report.longreprtext or report.longrepr or "")
    except Exception:  # a report that cannot render itself still counts
        return repr(report.longrepr)
