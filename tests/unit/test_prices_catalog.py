"""The on-demand price table (catalog/prices.yaml): every row sourced and dated, only catalog types, no guesses."""

from __future__ import annotations

from datetime import date
from importlib import resources

import json
import pytest
import yaml

from trainlift import catalog

TABLE = yaml.safe_load(resources.files("trainlift.catalog").joinpath("prices.yaml").read_text())
ROWS = [(region, name, row) for region, rows in TABLE["prices"].items() for name, row in rows.items()]


@pytest.mark.parametrize("region, name, row", ROWS, ids=[f"{r}/{n}" for r, n, _ in ROWS])
def test_every_row_names_a_source_text_and_the_day_it_was_checked(region, name, row):
    assert set(row) == {"usd_per_hour", "source", "as_of"}
    assert TABLE["sources"][row["source"]].strip()
    assert isinstance(row["as_of"], date) and date(2025, 6, 1) <= row["as_of"] <= date.today()
    price = catalog.on_demand_price(name, region)
    assert price is not None and price.usd_per_hour == row["usd_per_hour"] > 0
    assert (price.source, price.as_of) == (row["source"], row["as_of"])


def test_every_priced_type_is_in_the_hardware_catalog():
    assert {name for _, name, _ in ROWS} <= set(catalog.instance_types())


def test_every_source_is_used():
    assert set(catalog.price_sources()) == {row["source"] for _, _, row in ROWS}


def test_the_regions_the_catalog_prices():
    assert {"us-east-1", "us-east-2", "us-west-2"} <= set(catalog.price_regions())
    assert set(TABLE["prices"]["us-east-1"]) == set(catalog.instance_types()) - {"p5e.48xlarge"}


@pytest.mark.parametrize("name, usd", [("p5.48xlarge", 55.04), ("g6.12xlarge", 4.6016)])
def test_the_reference_prices_in_us_east_1(name, usd):
    """FACTS: p5.48xlarge about $55/h after the June 2025 cut, g6.12xlarge about $4.60/h."""
    price = catalog.on_demand_price(name, "us-east-1")
    assert price is not None and price.usd_per_hour == usd > 0
    assert price.to_dict() == {"instance_type": name, "region": "us-east-1", "usd_per_hour": usd,
                               "source": "karpenter-2026-02-09", "as_of": "2026-12-06"}


def test_what_the_catalog_does_not_know_is_none_not_a_guess():
    assert catalog.on_demand_price("p5.48xlarge", "eu-west-1") is None
    assert catalog.on_demand_price("p5.48xlarge", "us-east-2") is None
    assert catalog.on_demand_price("p5e.48xlarge", "us-east-1") is None
    assert catalog.on_demand_price("g9.huge", "us-east-1") is None


def test_price_and_estimate_share_a_default_region(monkeypatch, tmp_path):
    """With no region configured anywhere, `price` answers for us-east-1 as `estimate` does, instead of refusing."""
    from typer.testing import CliRunner

    from trainlift.cli import app

    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    done = CliRunner().invoke(app, ["price", "p5.48xlarge", "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["region"] == "us-east-1"
