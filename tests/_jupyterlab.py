"""A real JupyterLab server and a headless chromium driving it, for the browser tests.

The server is a subprocess this module owns (its own session, so its process group holds
it and the kernels it starts); stopping it signals exactly that group. Settings, workspaces,
runtime files and IPython's profile live in a temporary directory, so the user's own
configuration cannot change what the page looks like.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Mapping, Optional

from colab_xla.notebook.launch import free_port

CHROMIUM = Path("/usr/lib/chromium/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
]
SERVER_START_TIMEOUT = 90  # s; a cold start on a 2-core CI machine takes ~5-15 s


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "<no log>"


class JupyterLabServer:
    """``jupyter lab`` on 127.0.0.1 serving ``root_dir``, with a random token (``url``
    carries it: another local user reaches the port, but without the token runs nothing)."""

    def __init__(self, root_dir: Path, state_dir: Path, env: Mapping[str, str]):
        self.root_dir, self.state_dir = Path(root_dir), Path(state_dir)
        self.port = free_port()
        self.token = secrets.token_urlsafe(24)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.state_dir / "jupyter-lab.log"
        self._env = dict(env)
        self._proc: Optional[subprocess.Popen] = None

    def start(self) -> "JupyterLabServer":
        env = dict(self._env)
        env.pop("PYTEST_CURRENT_TEST", None)  # ipykernel turns fd capture off when it sees it
        for var, sub in (("JUPYTERLAB_SETTINGS_DIR", "lab-settings"),
                         ("JUPYTERLAB_WORKSPACES_DIR", "lab-workspaces"),
                         ("JUPYTER_RUNTIME_DIR", "runtime"),
                         ("IPYTHONDIR", "ipython")):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
            env[var] = str(self.state_dir / sub)
        # no "would you like to get notified about Jupyter news?" toast over the page
        notification = (self.state_dir / "lab-settings" / "@jupyterlab" / "apputils-extension"
                        / "notification.jupyterlab-settings")
        notification.parent.mkdir(parents=True, exist_ok=True)
        notification.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
               f"--port={self.port}",
               "--ServerApp.port_retries=0", f"--ServerApp.token={self.token}",
               "--ServerApp.password=",
               "--ServerApp.disable_check_xsrf=True", "--allow-root",
               f"--ServerApp.root_dir={self.root_dir}",
               "--LabApp.news_url=None",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        self._log = open(self.log_path, "wb")
        self._proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        last = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self._proc.returncode} before "
                                   f"answering:\n{_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(f"{self.url}/api?token={self.token}", timeout=5) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError) as e:
                last = e
            time.sleep(0.25)
        raise RuntimeError(f"jupyter lab did not answer on {self.url}/api within "
                           f"{SERVER_START_TIMEOUT} s (last error: {last}):\n"
                           f"{_tail(self.log_path)}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        # start_new_session=True: the server's pid is its process group id. The group holds
        # the server, its kernels and their replicas, and nothing else.
        pgid = proc.pid
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        # kernels outlive a server that exits on SIGTERM only briefly; make sure of it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        self._log.close()

    def log_tail(self, chars: int = 4000) -> str:
        return _tail(self.log_path, chars)


@contextlib.contextmanager
def jupyterlab(root_dir: Path, state_dir: Path,
               env: Mapping[str, str]) -> Iterator[JupyterLabServer]:
    server = JupyterLabServer(root_dir, state_dir, env)
    try:
        yield server.start()
    finally:
        server.stop()


class ClassicNotebookServer(JupyterLabServer):
    """``jupyter notebook`` (classic, 6.x) on 127.0.0.1, with a random token as above.

    ``nbextensions``: a directory whose ``share/jupyter`` comes first on JUPYTER_PATH, for
    the widget frontend to serve (see tests/test_browser_classic.py).
    """

    def __init__(self, root_dir: Path, state_dir: Path, env: Mapping[str, str],
                 frontend_dir: Optional[Path] = None):
        super().__init__(root_dir, state_dir, env)
        self.log_path = self.state_dir / "jupyter-notebook.log"
        if frontend_dir is not None:
            self._env["JUPYTER_PATH"] = str(Path(frontend_dir) / "share" / "jupyter")

    def start(self) -> "ClassicNotebookServer":
        env = dict(self._env)
        env.pop("PYTEST_CURRENT_TEST", None)
        for var, sub in (("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTER_CONFIG_DIR", "config"),
                         ("IPYTHONDIR", "ipython")):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
            env[var] = str(self.state_dir / sub)
        cmd = [sys.executable, "-m", "notebook", "--no-browser", "--ip=127.0.0.1",
               f"--port={self.port}", "--NotebookApp.port_retries=0",
               f"--NotebookApp.token={self.token}",
               "--NotebookApp.password=", "--NotebookApp.disable_check_xsrf=True",
               "--allow-root", f"--notebook-dir={self.root_dir}"]
        self._log = open(self.log_path, "wb")
        self._proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready()
        return self


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                      args=CHROMIUM_ARGS)


# --- driving a notebook -------------------------------------------------------------------

KERNEL_IDLE = ".jp-Notebook-ExecutionIndicator[data-status='idle']"

# True once any cell shows a busy [*] prompt or an execution count: Run All was taken.
_RUN_STARTED_JS = """() => Array.from(document.querySelectorAll('.jp-Notebook .jp-InputPrompt'))
    .some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))"""


# The toolbar's execution indicator says "idle" once before any kernel exists ("No Kernel |
# Initializing" in the status bar), and a Run All taken then is dropped. Ready means: the
# indicator is idle and the status bar names a kernel that is idle after connecting.
_KERNEL_READY_JS = """() => {
    const ind = document.querySelector(".jp-Notebook-ExecutionIndicator");
    if (!ind || ind.getAttribute("data-status") !== "idle") return false;
    return Array.from(document.querySelectorAll(".jp-StatusBar-TextItem"))
        .some(e => /^(?!No Kernel).+ \\| Idle$/.test(e.textContent.trim()));
}"""


def open_notebook(page, server: JupyterLabServer, name: str, timeout_s: float = 120) -> None:
    """Open ``name`` in a fresh workspace and wait for its kernel to be connected and idle."""
    page.goto(f"{server.url}/lab/tree/{name}?reset&token={server.token}",
              wait_until="domcontentloaded", timeout=timeout_s * 1000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout_s * 1000)
    page.wait_for_function(_KERNEL_READY_JS, timeout=timeout_s * 1000, polling=100)


def run_all_cells(page, attempts: int = 4, started_within_s: float = 4) -> int:
    """Run > Run All Cells; return how many tries it took. Tries again if no cell started
    within a few seconds (a safety net: after :func:`open_notebook`'s readiness check the
    first try has always been taken)."""
    for attempt in range(1, attempts + 1):
        page.locator(".lm-MenuBar-item", has_text=re.compile(r"^\s*Run\s*$")).first.click()
        page.locator(".lm-Menu-item:visible", has_text="Run All Cells").first.click()
        try:
            page.wait_for_function(_RUN_STARTED_JS, timeout=started_within_s * 1000)
            return attempt
        except Exception:  # playwright TimeoutError: close any open menu, try again
            page.keyboard.press("Escape")
    raise AssertionError(f"Run All Cells started no cell in {attempts} attempts")


def wait_until(predicate, timeout_s: float, interval_s: float = 0.25, what: str = "condition"):
    """Poll ``predicate()`` until truthy; return its value. On timeout, raise with ``what``
    (a string, or a callable giving the state to report)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_s} s waiting for {detail}")
        time.sleep(interval_s)
