"""The Price List API side of prices: the pure parser, filters and endpoint choice, and `Aws.on_demand_price`'s one-line
errors against an endpoint that is not there, missing credentials and a denied call."""

from __future__ import annotations

import json
import socket
import time
from datetime import date
from pathlib import Path

import pytest
from botocore.stub import Stubber

from trainlift.cloud import pricing
from trainlift.cloud.aws import Aws
from trainlift.errors import TrainliftError

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "pricing-get-products-ebs-piops.json"


def recorded_price_list() -> list[str]:
    return json.loads(RECORDED.read_text())["PriceList"]


def hourly_product(usd: str, instance_type: str = "g6.12xlarge") -> str:
    """The recorded product with its one price dimension turned into an instance-hour price of `usd`."""
    product = json.loads(recorded_price_list()[0])
    product["product"]["attributes"] = {"instanceType": instance_type, "operatingSystem": "Linux", "tenancy": "Shared"}
    offer = next(iter(product["terms"]["OnDemand"].values()))
    dimension = next(iter(offer["priceDimensions"].values()))
    dimension.update(unit="Hrs", pricePerUnit={"USD": usd})
    return json.dumps(product)


def test_the_recorded_response_gives_exactly_its_stated_price():
    """The `aws pricing get-products` example of the AWS CLI reference (docs.aws.amazon.com/cli/latest/reference/
    pricing/get-products.html, from github.com/aws/aws-cli awscli/examples/pricing/get-products.rst): one Provisioned
    IOPS EBS product in Singapore, "$0.138 per GB-month", published 2018-08-08."""
    price_list = recorded_price_list()
    assert pricing.on_demand_usd(price_list, unit="GB-Mo") == 0.138
    assert pricing.publication_date(price_list) == date(2018, 8, 8)


def test_a_response_without_an_hourly_price_is_one_clear_error():
    with pytest.raises(TrainliftError) as caught:
        pricing.on_demand_usd(recorded_price_list(), what="g6.12xlarge in us-east-1")
    line = caught.value.one_line()
    assert line.startswith("the AWS Price List API has no on-demand price for g6.12xlarge in us-east-1 "
                           "(no on-demand USD price per Hrs)")
    assert "\n" not in line


def test_an_empty_price_list_is_the_no_price_error():
    with pytest.raises(TrainliftError, match=r"no on-demand price for p5.48xlarge in mars-1 \(no product matches\)"):
        pricing.on_demand_usd(json.loads('{"FormatVersion": "aws_v1", "PriceList": []}')["PriceList"],
                              what="p5.48xlarge in mars-1")


def test_an_hourly_price_is_read_and_zero_prices_are_skipped():
    assert pricing.on_demand_usd([hourly_product("4.6016000000")]) == 4.6016
    assert pricing.on_demand_usd([hourly_product("0.0000000000"), hourly_product("4.6016")]) == 4.6016


def test_products_that_disagree_are_an_error_not_a_guess():
    with pytest.raises(TrainliftError, match=r"2 different on-demand prices for g6.12xlarge .*\$4.6016, \$5"):
        pricing.on_demand_usd([hourly_product("4.6016"), hourly_product("5.0")], what="g6.12xlarge")


def test_filters_pick_one_on_demand_linux_product():
    assert pricing.product_filters("g6.12xlarge", "us-east-2") == [
        {"Type": "TERM_MATCH", "Field": "ServiceCode", "Value": "AmazonEC2"},
        {"Type": "TERM_MATCH", "Field": "instanceType", "Value": "g6.12xlarge"},
        {"Type": "TERM_MATCH", "Field": "regionCode", "Value": "us-east-2"},
        {"Type": "TERM_MATCH", "Field": "operatingSystem", "Value": "Linux"},
        {"Type": "TERM_MATCH", "Field": "tenancy", "Value": "Shared"},
        {"Type": "TERM_MATCH", "Field": "preInstalledSw", "Value": "NA"},
        {"Type": "TERM_MATCH", "Field": "capacitystatus", "Value": "Used"},
    ]


@pytest.mark.parametrize("region, endpoint", [
    ("us-east-1", "us-east-1"), ("us-east-2", "us-east-1"), ("us-west-2", "us-east-1"), ("ca-central-1", "us-east-1"),
    ("sa-east-1", "us-east-1"), ("eu-west-1", "eu-central-1"), ("eu-north-1", "eu-central-1"),
    ("me-south-1", "eu-central-1"), ("af-south-1", "eu-central-1"), ("ap-northeast-1", "ap-south-1"),
    ("ap-southeast-2", "ap-south-1"), ("ap-south-1", "ap-south-1"),
])
def test_the_nearest_price_list_endpoint(region, endpoint):
    assert pricing.price_list_region(region) == endpoint
    assert endpoint in pricing.PRICE_LIST_ENDPOINTS


@pytest.fixture
def no_aws_config(monkeypatch, tmp_path):
    for name in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                 "AWS_ENDPOINT_URL_PRICING", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    return monkeypatch


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_price_list_api_is_one_line_naming_the_fix(no_aws_config):
    port = _closed_port()
    no_aws_config.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    no_aws_config.setenv("AWS_ACCESS_KEY_ID", "testing")
    no_aws_config.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    aws = Aws("eu-west-1")
    client = aws.client("pricing", region="eu-central-1")
    assert (client.meta.region_name, client.meta.endpoint_url) == ("eu-central-1", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(TrainliftError) as caught:
        aws.on_demand_price("g6.12xlarge")
    assert time.monotonic() - start < 5
    line = caught.value.one_line()
    assert line == (f'cannot reach the AWS Price List API (eu-central-1): Could not connect to the endpoint URL: '
                    f'"http://127.0.0.1:{port}/" (check the network, the proxy and AWS_ENDPOINT_URL, or use the '
                    f'catalog price: drop --live)')


def test_missing_credentials_are_one_line_naming_the_fix(no_aws_config):
    with pytest.raises(TrainliftError) as caught:
        Aws("us-east-2").on_demand_price("g6.12xlarge")
    line = caught.value.one_line()
    assert line.startswith("the AWS Price List API (us-east-1) needs AWS credentials and none were found (")
    assert line.endswith("or use the catalog price: drop --live)")


def _stubbed(no_aws_config) -> tuple[Aws, Stubber]:
    no_aws_config.setenv("AWS_ACCESS_KEY_ID", "testing")
    no_aws_config.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    aws = Aws("us-east-2")
    stubber = Stubber(aws.client("pricing", region="us-east-1"))
    stubber.activate()
    return aws, stubber


def test_a_denied_call_names_the_permission(no_aws_config):
    aws, stubber = _stubbed(no_aws_config)
    stubber.add_client_error("get_products", service_error_code="AccessDeniedException", http_status_code=400,
                             service_message="User is not authorized to perform: pricing:GetProducts")
    with pytest.raises(TrainliftError) as caught:
        aws.on_demand_price("g6.12xlarge")
    assert caught.value.one_line() == (
        "the AWS Price List API (us-east-1) denied pricing:GetProducts (User is not authorized to perform: "
        "pricing:GetProducts) (allow pricing:GetProducts for these credentials, or use the catalog price: drop --live)")


def test_a_live_price_is_the_answers_price_with_its_publication_date(no_aws_config):
    aws, stubber = _stubbed(no_aws_config)
    expected = {"ServiceCode": "AmazonEC2", "Filters": pricing.product_filters("g6.12xlarge", "us-east-2"),
                "MaxResults": 100}
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [hourly_product("4.6016")]},
                         expected)
    price = aws.on_demand_price("g6.12xlarge")
    assert (price.instance_type, price.region, price.usd_per_hour) == ("g6.12xlarge", "us-east-2", 4.6016)
    assert (price.source, price.as_of) == ("aws-price-list-api", date(2018, 8, 8))
    stubber.assert_no_pending_responses()


def test_a_live_answer_without_products_is_the_no_price_error(no_aws_config):
    aws, stubber = _stubbed(no_aws_config)
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": []})
    with pytest.raises(TrainliftError, match=r"no on-demand price for g9.huge in us-east-2 \(no product matches\)"):
        aws.on_demand_price("g9.huge")
