"""Execute notebooks headless, as a reader's Run All would, and keep what they showed.

Usage::

    python tools/run_notebooks.py [NOTEBOOK ...] [--out DIR] [--timeout S] [--html-widgets]

Without NOTEBOOK, every ``notebooks/*.ipynb`` of the repository runs, in name order.
Each notebook runs in a fresh ``python3`` kernel (this interpreter's ipykernel) with the
notebook's directory as working directory, reached over IPC (Unix sockets in a private
temporary directory), not TCP. The executed copy goes to ``DIR/NAME.ipynb``
and an HTML rendering to ``DIR/NAME.html`` (default DIR: ``build/notebooks``), also when a
cell fails; one line per notebook says how it went. The exit status is non-zero if any
notebook failed.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
DEFAULT_OUT = REPO_ROOT / "build" / "notebooks"
DEFAULT_TIMEOUT = 300  # seconds per cell

# PJRT_DEVICE as the user set it before anything here ran. Importing torch_xla (in a test
# session, say) writes a default PJRT_DEVICE into os.environ; the kernel must not inherit
# that, so colab_xla in the notebook finds the hardware itself.
_USER_PJRT_DEVICE = os.environ.get("PJRT_DEVICE")


class NotebookError(Exception):
    """A notebook did not run to the end. Its executed copy and HTML were still written.

    ``nb`` is the notebook as far as it ran; ``cell_index`` the failing cell's index in
    ``nb.cells`` (or None); the message counts cells from 1, as a reader does.
    """

    def __init__(self, message: str, nb, html_path: Path, ipynb_path: Path,
                 cell_index: Optional[int]):
        super().__init__(message)
        self.nb, self.html_path, self.ipynb_path = nb, html_path, ipynb_path
        self.cell_index = cell_index


def kernel_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The kernel's environment: ours, without PYTEST_CURRENT_TEST (ipykernel turns its
    capture of C-level output off when it sees it) and without a PJRT_DEVICE the user did
    not set."""
    env = dict(os.environ if environ is None else environ)
    env.pop("PYTEST_CURRENT_TEST", None)
    if _USER_PJRT_DEVICE is None:
        env.pop("PJRT_DEVICE", None)
    else:
        env["PJRT_DEVICE"] = _USER_PJRT_DEVICE
    return env


@contextlib.contextmanager
def ipc_connection() -> Iterator[Dict[str, str]]:
    """KernelManager settings for a kernel reached over IPC: its connection file and Unix
    sockets in a private temporary directory (mode 0700), removed afterwards.

    Over TCP, ipykernel 7 warns at every start that code and outputs go unencrypted; over
    IPC only this user can reach the sockets. The paths are absolute: jupyter_client's
    default for IPC is ``kernel-ipc`` (or one next to a connection file that is not yet
    named when it is read), relative to the client's working directory, which the kernel,
    started in the notebook's directory, would resolve differently.
    """
    directory = tempfile.mkdtemp(prefix="colab_xla-kernel-")
    try:
        yield {"transport": "ipc", "ip": os.path.join(directory, "kernel"),
               "connection_file": os.path.join(directory, "kernel.json")}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def execute(nb, *, env: Optional[Mapping[str, str]] = None, **options) -> None:
    """Run ``nb`` (a NotebookNode, changed in place) in a fresh ``python3`` kernel reached
    over IPC (:func:`ipc_connection`); raises what ``NotebookClient.execute`` raises.
    ``options`` go to nbclient's ``NotebookClient``; ``env`` defaults to :func:`kernel_env`.
    """
    from nbclient import NotebookClient
    from traitlets.config import Config

    with ipc_connection() as connection:
        # nbclient makes its kernel manager with its own config: the KernelManager section
        # reaches the AsyncKernelManager it makes (a subclass).
        client = NotebookClient(nb, kernel_name="python3",
                                config=Config({"KernelManager": connection}), **options)
        client.execute(env=kernel_env() if env is None else dict(env))


def execute_notebook(path, out_dir, timeout: float = DEFAULT_TIMEOUT, *,
                     env: Optional[Mapping[str, str]] = None,
                     html_widgets: bool = False) -> Tuple[object, Path, Path]:
    """Run the notebook at ``path``; write ``out_dir/NAME.ipynb`` and ``out_dir/NAME.html``.

    Returns ``(executed_nb, html_path, ipynb_path)``. If a cell fails (or times out, or the
    kernel dies), both files are written with what ran and :class:`NotebookError` is raised.
    ``timeout`` is per cell, in seconds; ``env`` defaults to :func:`kernel_env`.

    The executed copy keeps the widgets' state (JupyterLab draws them again). The HTML,
    unless ``html_widgets``, shows what each widget output carries besides the widget
    (colab_xla's static per-replica summary): with the state embedded, nbconvert shows
    only the widget, which JavaScript draws from a CDN when the page is opened.
    """
    import nbformat

    path = Path(path).resolve()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ipynb_path = out_dir / path.name
    html_path = out_dir / (path.stem + ".html")

    nb = nbformat.read(path, as_version=4)
    # nbclient's timeout is an Integer trait: traitlets 5.7.1 (Colab's pin) refuses
    # a float such as --timeout 240's 240.0 (newer traitlets take it).
    failure: Optional[BaseException] = None
    try:
        execute(nb, env=env, timeout=None if timeout is None else math.ceil(timeout),
                store_widget_state=True, resources={"metadata": {"path": str(path.parent)}})
    except Exception as exc:  # CellExecutionError, CellTimeoutError, DeadKernelError, ...
        failure = exc

    nbformat.write(nb, ipynb_path)
    html_path.write_text(_html(nb, html_widgets), encoding="utf-8")
    if failure is not None:
        index = _failing_cell(nb)
        where = f"cell {index + 1} of {len(nb.cells)}" if index is not None else "kernel"
        raise NotebookError(f"{where}: {_first_line(failure)}", nb, html_path, ipynb_path,
                            index) from failure
    return nb, html_path, ipynb_path


def _html(nb, widgets: bool) -> str:
    import copy

    from nbconvert import HTMLExporter

    if not widgets and "widgets" in nb.metadata:
        nb = copy.deepcopy(nb)
        del nb.metadata["widgets"]
    body, _ = HTMLExporter().from_notebook_node(nb)
    return body


def _failing_cell(nb) -> Optional[int]:
    """Index of the first code cell with an unexpected error output (not tagged
    ``raises-exception``), else of the last one that began."""
    started = None
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        expected = "raises-exception" in cell.get("metadata", {}).get("tags", [])
        if not expected and any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            return i
        if cell.get("execution_count") is not None or cell.get("metadata", {}).get("execution"):
            started = i
    return started


def _first_line(exc: BaseException) -> str:
    ename = getattr(exc, "ename", None)
    if ename:  # CellExecutionError: the kernel-side exception
        evalue = (getattr(exc, "evalue", "") or "").strip().splitlines()
        first = evalue[0] if evalue else ""
        if first.startswith(ename + ": "):  # a str(exc) that names its own class
            first = first[len(ename) + 2:]
        return f"{ename}: {first}" if first else ename
    text = str(exc).strip().splitlines()
    # nbclient's messages start with a blank line or a rule; keep the first meaningful one
    text = [line for line in text if line.strip() and set(line.strip()) - set("-")]
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def default_notebooks() -> List[Path]:
    return sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def _show(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/run_notebooks.py",
        description="Execute notebooks headless; write executed copies and HTML.")
    parser.add_argument("notebooks", nargs="*", type=Path, metavar="NOTEBOOK",
                        help="notebooks to run (default: notebooks/*.ipynb of the repository)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                        help=f"where executed copies and HTML go (default: {_show(DEFAULT_OUT)})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"seconds a cell may run (default: {DEFAULT_TIMEOUT})")
    parser.add_argument("--html-widgets", action="store_true",
                        help="embed widget state in the HTML: widgets drawn by JavaScript "
                             "(from a CDN) instead of their static text/HTML summaries")
    args = parser.parse_args(argv)

    notebooks = args.notebooks or default_notebooks()
    if not notebooks:
        print(f"no notebooks found in {_show(NOTEBOOKS_DIR)}", file=sys.stderr)
        return 2
    failed = 0
    for path in notebooks:
        started = time.perf_counter()
        try:
            _, html_path, ipynb_path = execute_notebook(path, args.out, args.timeout,
                                                        html_widgets=args.html_widgets)
            status, detail = "ok", ""
        except NotebookError as exc:
            html_path, ipynb_path = exc.html_path, exc.ipynb_path
            status, detail = "FAILED", f"  ({exc})"
            failed += 1
        except Exception as exc:  # could not even read or write it
            print(f"{'ERROR':6} {path.name}: {type(exc).__name__}: {exc}", flush=True)
            failed += 1
            continue
        took = time.perf_counter() - started
        print(f"{status:6} {path.name}  {took:6.1f} s  {_show(ipynb_path)}  {_show(html_path)}"
              f"{detail}", flush=True)
    if failed:
        print(f"{failed} of {len(notebooks)} notebooks failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
