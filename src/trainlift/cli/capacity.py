"""`trainlift capacity`: can this region run N of an instance type, and in which AZ."""

from __future__ import annotations

import sys
from typing import Optional

import typer
from rich import box
from rich.table import Table

from trainlift.cli.app import app, console, print_json
from trainlift.errors import UsageError


_LABELS = {
    "offered": "offered AZs", "quota_vcpus": "vCPU quota", "vcpus_in_use": "vCPUs in use",
    "reservations": "capacity reservations", "spot_scores": "spot placement scores",
}


def _cell(value: object, unknown: str = "?") -> str:
    return unknown if value is None else str(value)


@app.command("capacity")
def capacity(
    instance_type: str = typer.Argument(..., metavar="INSTANCE_TYPE", help="EC2 instance type, e.g. g6.12xlarge."),
    region: Optional[str] = typer.Option(
        None, "--region", "-r", help="AWS region, e.g. us-east-2; default: AWS_REGION, AWS_DEFAULT_REGION or the "
        "profile's region."),
    count: int = typer.Option(2, "--count", "-n", min=1, help="Instances you need in one AZ."),
    json_out: bool = typer.Option(False, "--json", help="Print the full report as JSON."),
) -> None:
    """Check before spending money: can this region run COUNT of a type, and in which AZ.

    Reports the AZs that offer the type, its GPUs and EFA interfaces, the on-demand vCPU quota of its family against vCPUs already running, capacity reservations (Capacity Blocks that have not started included) and spot placement scores; then the AZ to use and why, or what is missing with the command that fixes it.

    Uses the standard AWS configuration (AWS_PROFILE, AWS_REGION, AWS_ENDPOINT_URL, ...); without --region, the region it names. An API your credentials may not call is shown as unknown. Exits 1 when capacity is known to be missing.

    Example: trainlift capacity g6.12xlarge --region us-east-2 --count 2
    """
    from trainlift.catalog import on_demand_price
    from trainlift.cloud.aws import Aws, check_region, default_region
    from trainlift.cloud.capacity import assess

    if "." not in instance_type:
        raise UsageError(f"{instance_type!r} is not an EC2 instance type", hint="e.g. g6.12xlarge")
    region = region or default_region()
    if not region:
        raise UsageError("no AWS region: pass --region or set AWS_REGION", hint="e.g. --region us-east-2")
    check_region(region)
    aws = Aws(region)
    aws.identity()
    report = assess(aws.capacity(instance_type, count))
    price = on_demand_price(instance_type, region)
    if json_out:
        print_json({**report.to_dict(), **_price_fields(price)})
    else:
        _print(report, price)
    if not report.ok:
        sys.exit(1)


def _price_fields(price) -> dict[str, object]:
    """The catalog's on-demand price of one instance; nulls when the catalog has none."""
    return {
        "usd_per_hour": price.usd_per_hour if price else None,
        "price_source": price.source if price else None,
        "price_as_of": price.as_of.isoformat() if price else None,
    }


def _price_text(price, count: int, instance_type: str, region: str) -> str:
    from trainlift.estimate.cost import usd

    if price is None:
        return (f"no catalog price for {instance_type} in {region} "
                f"(`trainlift price {instance_type} --region {region} --live` asks AWS)")
    return (f"{usd(price.usd_per_hour)}/h on demand ({price.source}, checked {price.as_of.isoformat()}); "
            f"{_count_cost(price, count)}")


def _count_cost(price, count: int) -> str:
    from trainlift.estimate.cost import usd

    return f"{count} × {usd(price.usd_per_hour)}/h = {usd(count * price.usd_per_hour)}/h"


def _print(report, price=None) -> None:
    f, info = report.facts, report.facts.info
    gpus = f"{info.gpus}x {info.gpu_model} ({info.gpu_memory_mib / 1024:.0f} GiB each)" if info.gpus else "none"
    efa = f"supported, up to {info.efa_interfaces} interface(s)" if info.efa_supported else "not supported"
    console.print(f"[bold]{info.instance_type}[/] in [bold]{f.region}[/], {f.count} instance(s)", highlight=False)
    console.print(f"  GPUs     {gpus}\n  vCPUs    {info.vcpus} each, {report.needed_vcpus} for {f.count}\n"
                  f"  EFA      {efa}", highlight=False)
    console.print(f"  price    {_price_text(price, f.count, info.instance_type, f.region)}", highlight=False)
    if f.quota is None:
        quota = "no on-demand vCPU quota known for this family"
    elif report.free_vcpus is not None:
        quota = f"{f.quota.name} ({f.quota.code}): {f.quota_vcpus:g} vCPUs, {report.free_vcpus:g} free"
    else:
        quota = (f"{f.quota.name} ({f.quota.code}): unknown; check it with `aws service-quotas get-service-quota "
                 f"--service-code ec2 --quota-code {f.quota.code} --region {f.region}`")
    console.print(f"  quota    {quota}", highlight=False)
    in_use = "unknown" if "vcpus_in_use" in report.unknown else f"{f.vcpus_in_use} vCPUs of this family running"
    console.print(f"  in use   {in_use}", highlight=False)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    later = any(row.upcoming for row in report.rows)
    for column in ("AZ", "zone id", "offered", "reserved") + (("later",) if later else ()) + ("spot score",):
        table.add_column(column, justify="left" if column in ("AZ", "zone id") else "right")
    for row in report.rows:
        offered = {True: "yes", False: "no", None: "?"}[row.offered]
        upcoming = (_cell(row.upcoming),) if later else ()
        table.add_row(row.zone, row.zone_id, offered, _cell(row.reserved), *upcoming, _cell(row.spot_score, "-"))
    console.print(table)
    _print_upcoming(report)
    for key, why in report.unknown.items():
        console.print(f"  [yellow]unknown[/] {_LABELS.get(key, key)}: {why}", highlight=False)
    if report.recommended:
        cost = f"; {_count_cost(price, f.count)} on demand" if price else ""
        console.print(f"[green]recommended AZ: {report.recommended}[/] ({report.reason}){cost}", highlight=False)
    for problem in report.problems:
        console.print(f"[bold red]missing:[/] {problem}", highlight=False)
    for fix in report.fixes:
        console.print(f"  fix: {fix}", highlight=False)
    if not report.recommended and not report.problems:
        console.print(f"[yellow]no AZ recommended:[/] {report.reason}", highlight=False)


def _print_upcoming(report) -> None:
    """Reservations that have not started: a Capacity Block is bought ahead and shows 0 available until then."""
    if "reservations" in report.unknown:
        return
    for r in report.facts.reservations:
        if r.state != "active":
            kind = "Capacity Block" if r.is_block else "capacity reservation"
            console.print(f"  {kind} {r.id} ({r.state}): {r.total} in {r.zone} from {r.start or '?'} to "
                          f"{r.end or '?'}", highlight=False)
