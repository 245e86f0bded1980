"""`trainlift price`: the on-demand $/hour of an instance type, from the catalog or, with --live, from AWS."""

from __future__ import annotations

from typing import Optional

import typer

from trainlift.cli.app import app, console, print_json
from trainlift.errors import TrainliftError, UsageError


@app.command("price")
def price(
    instance_type: str = typer.Argument(..., metavar="INSTANCE_TYPE", help="EC2 instance type, e.g. g6.12xlarge."),
    region: Optional[str] = typer.Option(
        None, "--region", "-r", help="AWS region, e.g. us-east-2; default: AWS_REGION, AWS_DEFAULT_REGION or the "
        "profile's region, else us-east-1 (as `estimate`)."),
    live: bool = typer.Option(False, "--live", help="Ask AWS's Price List API (needs credentials) instead of the "
                              "catalog."),
    json_out: bool = typer.Option(False, "--json", help="Print the price as JSON."),
) -> None:
    """On-demand USD per hour of one instance (Linux, shared tenancy), with where the figure comes from.

    The catalog's prices are dated and name their source; they change. --live asks the AWS Price List API (the
    pricing:GetProducts action, from the endpoint nearest the region) for today's figure.

    Example: trainlift price p5.48xlarge --region us-east-1 --live
    """
    from trainlift.catalog import on_demand_price, price_regions
    from trainlift.catalog.prices import PRICE_REGION
    from trainlift.cloud.aws import Aws, check_region, default_region
    region = region or default_region() or PRICE_REGION
    check_region(region)
    found = Aws(region).on_demand_price(instance_type) if live else on_demand_price(instance_type, region)
    if found is None:
        raise TrainliftError(
            f"no catalog price for {instance_type} in {region}",
            hint="pass --live to ask the AWS Price List API; the catalog has prices for "
                 + ", ".join(price_regions()),
        )
    if json_out:
        print_json({**found.to_dict(), "live": live})
        return
    checked = "published" if live else "checked"
    exact = f"{found.usd_per_hour:,.4f}".rstrip("0").rstrip(".")
    console.print(f"{instance_type} in {region}: ${exact}/h on demand, Linux "
                  f"({found.source}, {checked} {found.as_of.isoformat()})", highlight=False)
