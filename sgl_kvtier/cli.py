"""``sgl-kvtier``: operator commands. ``main(argv) -> exit code`` is the only reader of ``sys.argv``.

    sgl-kvtier inspect PATH [--json]          per namespace: the pool (pages, bytes used of the capacity,
                                              writers live/dead) and every writer (host, pid, state, lease
                                              age, pages, bytes, share of the capacity, journal cursor)
    sgl-kvtier fsck PATH [--repair] [--json]  verify every writer's records and page checksums; repair
                                              drops bad ones (dead writers of this host only)
    sgl-kvtier fsck PATH --rebuild [--json]   rebuild each writer's index from its pages' slot trailers
    sgl-kvtier check-shared DIR [--peer-wait S] [--json]   is DIR fit for sharing = "cluster": filesystem type
                                              and class, O_DIRECT, create-once, rename, fsync; with
                                              --peer-wait, another host running it at once seen there
    sgl-kvtier pool-format DEV [DEV ...] --hosts H [--yes] [--json]   format raw namespaces (blank: all zeros at
                                              their first and last MiB) once, from one host, as a shared raw
                                              pool of H host slots; without --yes only shows what it would write
    sgl-kvtier launch --config X.toml [--print] [-- extra sglang args]   (see sgl_kvtier.serving.launch)
    sgl-kvtier demo [--dir D] [--turns N]     a real SGLang server on CPU: hits from flash after a flush/restart
    sgl-kvtier plan --trace T --model M ...   replay a request trace: hit rate, TTFT and flash traffic per L3
                                              size, and advice (see sgl_kvtier.plan)
    sgl-kvtier verify --config X.toml | --endpoint l3=URL ...   the same prompts with the L3 and without
                                              (hbm-only / l2-only) at each concurrency; exit 1 unless the
                                              gates pass (see sgl_kvtier.verify)

Exit codes: 0 ok, 1 problems found (or an error), 2 usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

from sgl_kvtier.errors import KVTierError
from sgl_kvtier.plan.cli import add_plan_parser
from sgl_kvtier.serving.launch import add_launch_parser
from sgl_kvtier.verify.cli import add_verify_parser

if TYPE_CHECKING:
    from sgl_kvtier.admin.fsck import Shard


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    if abs(n) < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if abs(size) < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" if seconds < 600 else f"{seconds / 3600:.1f} h" if seconds >= 3600 else \
        f"{seconds / 60:.0f} min"


def _state(w: dict[str, Any]) -> str:
    if w["state"] == "unknown":
        return "unknown (other host" + (", lease stale)" if w["lease_stale"] else ")")
    if w.get("sharing") == "off":
        return f"{w['state']} (sharing off, no lease)"
    return str(w["state"])


def cmd_inspect(args: argparse.Namespace, console: Console) -> int:
    """``sgl-kvtier inspect``: every namespace's pool under a path and each of its writers, as tables or
    JSON (``sharing.pool_status``); reads only."""
    from sgl_kvtier.admin.fsck import find_shards, shard_summary

    shards = find_shards(args.path)
    rows = [shard_summary(s) for s in shards]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0 if rows else 1  # as the table: no store there is an error
    if not rows:
        console.print(f"no sgl-kvtier store at {args.path}")
        return 1
    for r in rows:
        share = "" if not r["capacity_bytes"] else f" ({100 * r['bytes_used'] / r['capacity_bytes']:.1f}%)"
        console.print(f"[bold]{r['namespace']}[/bold]  ns-{r['digest']}  format {r['format_version']}")
        console.print(f"  pool: {r['pages']} pages, {_human(r['bytes_used'])} of {_human(r['capacity_bytes'])}"
                      f"{share}; writers: {r['writers_live']} live, {r['writers_dead']} dead, "
                      f"{r['writers_unknown']} unknown; devices: {', '.join(r['devices'])}; "
                      f"O_DIRECT: {'yes' if r['direct_io'] else 'no'}")
        table = Table(title=f"writers of ns-{r['digest'][:12]} (lease age: since its {r['lease_age_from']})")
        for col in ("wid", "host", "pid", "state", "lease age", "pages", "bytes used", "share", "journal"):
            table.add_column(col, no_wrap=True)
        for w in r["writers"]:
            journal = "-" if w["journal"] is None else f"{w['journal'][0]}:{w['journal'][1]}"
            share_pct = "-" if w["share_pct"] is None else f"{w['share_pct']:.1f}%"
            table.add_row(w["wid"], str(w["host"] or "-"), str(w["pid"] or "-"), _state(w), _age(w["lease_age_s"]),
                          str(w["pages"]) + ("" if w["source"] == "index" else " (lease)"),
                          _human(w["bytes_used"]), share_pct, journal)
        console.print(table)
        for problem in r["problems"]:
            console.print(f"  [yellow]problem:[/yellow] {problem}")
    return 0


def _advance(progress: Progress, task: TaskID, pages: int) -> None:
    progress.advance(task, pages)


def cmd_fsck(args: argparse.Namespace, console: Console) -> int:
    """``sgl-kvtier fsck``: verify (and with ``--repair`` fix) every shard; 1 if any stays bad. With
    ``--rebuild``: rebuild every writer's index from its pages; 1 if any writer could not be rebuilt."""
    from sgl_kvtier.admin.fsck import find_shards, fsck_pool

    shards = find_shards(args.path)
    if not shards:
        console.print(f"no sgl-kvtier store at {args.path}")
        return 1
    if args.rebuild:
        return _rebuild(args, console, shards)
    reports = []
    with Progress(console=console, transient=True, disable=args.json) as progress:
        def start(label: str, total: int) -> functools.partial[None]:
            return functools.partial(_advance, progress, progress.add_task(f"verifying {label}", total=total))

        for shard in shards:
            reports += fsck_pool(shard, repair=args.repair, progress=start)
    if args.json:
        print(json.dumps([r.__dict__ for r in reports], indent=2))
    else:
        table = Table(title="fsck")
        for col in ("namespace", "writer", "pages checked", "bad pages", "journal/checkpoint problems", "repaired"):
            table.add_column(col)
        for r in reports:
            repaired = "yes" if r.repaired else f"skipped: {r.skipped}" if r.skipped else "no"
            table.add_row(r.namespace, r.wid or "-", str(r.pages_checked), str(len(r.bad_pages)),
                          "\n".join(r.problems) or "none", repaired)
        console.print(table)
    return 0 if all(r.clean or r.repaired for r in reports) else 1


def _rebuild(args: argparse.Namespace, console: Console, shards: list[Shard]) -> int:
    """``fsck --rebuild``: every writer of every shard, a progress bar each (none with ``--json``)."""
    from sgl_kvtier.admin.fsck import rebuild_shard

    outcomes = []
    with Progress(console=console, transient=True, disable=args.json) as progress:
        def start(label: str, total: int) -> functools.partial[None]:
            return functools.partial(_advance, progress, progress.add_task(f"rebuilding {label}", total=total))

        for shard in shards:
            outcomes += rebuild_shard(shard, progress=start)
    if args.json:
        print(json.dumps([{"namespace": o.namespace, "wid": o.wid, "error": o.error,
                           "report": None if o.report is None else o.report.__dict__} for o in outcomes], indent=2))
    else:
        table = Table(title="fsck --rebuild")
        for col in ("namespace", "writer", "slots read", "pages kept", "torn / stale", "other namespace",
                    "bad trailers", "unreadable", "error"):
            table.add_column(col)
        for o in outcomes:
            r = o.report
            cells = ["-"] * 6 if r is None else [str(v) for v in (r.slots_scanned, r.pages, r.torn, r.foreign,
                                                                    r.bad_trailer, r.unreadable)]
            table.add_row(o.namespace, o.wid, *cells, o.error or "none")
        console.print(table)
    if not outcomes and not args.json:
        console.print("no writer found to rebuild")
    return 0 if outcomes and all(o.error is None for o in outcomes) else 1


def cmd_check_shared(args: argparse.Namespace, console: Console) -> int:
    """``sgl-kvtier check-shared``: ``sharing.cluster_fs.probes.check_shared`` on a directory; 0 when it is fit for
    ``sharing = "cluster"``, 1 otherwise (each reason printed)."""
    from sgl_kvtier.sharing.cluster_fs.probes import check_shared

    if args.peer_wait is not None and args.peer_wait < 0:
        console.print("[red]error:[/red] --peer-wait: must be >= 0 seconds")
        return 2
    report = check_shared(args.path, peer_wait_s=args.peer_wait)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0 if report.fit else 1
    fs = report.fs
    console.print(f"[bold]{report.path}[/bold]: {fs.fstype or 'unknown'} ({fs.fs_class.value.replace('_', ' ')}), "
                  f"mounted at {fs.mount_point} from {fs.source or '-'}{', read-only' if fs.read_only else ''}",
                  highlight=False, soft_wrap=True)
    for probe in report.probes:
        verdict = (probe.detail or "yes") if probe.ok else f"[red]no[/red]: {probe.detail}"
        console.print(f"  {probe.name}: {verdict}", highlight=False, soft_wrap=True)
    if args.peer_wait is not None:
        peer = report.peer
        seen = "not seen" if peer is None else f"{peer.get('host')} (boot_id {peer.get('boot_id')}, pid {peer.get('pid')})"
        console.print(f"  another host: {seen}", highlight=False, soft_wrap=True)
    for note in report.notes:
        console.print(f"  [yellow]note:[/yellow] {note}", highlight=False, soft_wrap=True)
    if report.fit:
        console.print('fit for sharing = "cluster"', highlight=False, soft_wrap=True)
        return 0
    console.print('[red]not fit for sharing = "cluster"[/red]:', highlight=False, soft_wrap=True)
    for problem in report.problems:
        console.print(f"  - {problem}", highlight=False, soft_wrap=True)
    return 1


def cmd_pool_format(args: argparse.Namespace, console: Console) -> int:
    """``sgl-kvtier pool-format``: ``media.shared_raw.superblock.format_pool``; 0 once written, 1 with nothing written
    (no ``--yes``, or a device refused: never formatted over)."""
    from sgl_kvtier.media.shared_raw.superblock import format_pool

    sbs = format_pool(list(args.devices), args.hosts, write=args.yes)
    if args.json:
        print(json.dumps({"written": args.yes, "devices": [{"path": sb.path, **sb.fields()} for sb in sbs]}, indent=2))
    else:
        table = Table(title=f"shared raw pool {sbs[0].pool_id}: {args.hosts} host slots"
                            + ("" if args.yes else " (NOT written)"))
        for col in ("device", "index", "bytes", "data from", "per host"):
            table.add_column(col)
        for sb in sbs:
            table.add_row(sb.path, f"{sb.device_index} of {sb.device_count}", str(sb.device_bytes),
                          str(sb.data_at), _human(sb.share_bytes))
        console.print(table)
        if args.yes:
            console.print(f'every host: sharing = "cluster", devices = {list(args.devices)} in this order, and its own '
                          f"host_index (0..{args.hosts - 1}); no meta_dir", highlight=False, soft_wrap=True)
        else:
            console.print("nothing written: run again with --yes to format", highlight=False)
    return 0 if args.yes else 1


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    """``sgl-kvtier demo``: see ``sgl_kvtier.serving.demo``."""
    from sgl_kvtier.serving.demo import main as demo_main

    return demo_main(args.dir, args.turns)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    parser = argparse.ArgumentParser(prog="sgl-kvtier", description="NVMe / NVMe-oF flash tier for SGLang HiCache")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="show the namespaces, pages and capacity of a store")
    p.add_argument("path", help="a device directory, a meta directory or a raw block device")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("fsck", help="verify every journal record and page checksum")
    p.add_argument("path")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--repair", action="store_true", help="drop bad pages and torn journal tails")
    mode.add_argument("--rebuild", action="store_true",
                      help="rebuild each writer's index (journal + checkpoint) from its pages alone")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fsck)
    p = sub.add_parser("check-shared", help='check that a directory is fit for sharing = "cluster"')
    p.add_argument("path", help="a directory on the filesystem the pool's hosts share")
    p.add_argument("--peer-wait", type=float, default=None, metavar="S",
                   help="leave a probe and wait up to S seconds for one of another host running this at once")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_check_shared)
    p = sub.add_parser("pool-format", help="format blank raw namespaces once as a pool shared by several hosts")
    p.add_argument("devices", nargs="+", help="raw block devices (NVMe-oF namespaces), in striping order")
    p.add_argument("--hosts", type=int, required=True, help="host slots: each host gets host_index 0..H-1")
    p.add_argument("--yes", action="store_true", help="write it (without: show what would be written)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_pool_format)
    p = sub.add_parser("demo", help="the README's main job: real SGLang on CPU, flush, restart, hits from flash")
    p.add_argument("--dir", default=".kvtier-demo", help="directory used as the flash device (wiped first)")
    p.add_argument("--turns", type=int, default=3, help="turns of the conversation")
    p.set_defaults(func=cmd_demo)
    add_launch_parser(sub)
    add_plan_parser(sub)
    add_verify_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``); the exit code."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    args.extra = extra
    console = Console(stderr=False)
    try:
        code: int = args.func(args, console)
        return code
    except KVTierError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
