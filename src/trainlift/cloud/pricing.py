"""The AWS Price List API, pure: which endpoint to ask, the filters that pick one on-demand Linux price, reading the
`get_products` answer, and the one-line errors. The call itself is `Aws.on_demand_price` in cloud/aws.py.

A `get_products` answer carries a `PriceList` of JSON strings, one per product; a product's on-demand price is at
terms.OnDemand.<offer>.priceDimensions.<rate>.pricePerUnit.USD, per `unit` ("Hrs" for an instance-hour).
"""

from __future__ import annotations

import json
from datetime import date, datetime
from typing import Any

from trainlift.cloud.aws_errors import CREDENTIALS_HINT, REJECTED_CODES, error_code, error_message
from trainlift.errors import TrainliftError

LIVE_SOURCE = "aws-price-list-api"
PRICE_LIST_ENDPOINTS = ("us-east-1", "eu-central-1", "ap-south-1")
_NEAREST_ENDPOINT = {"eu": "eu-central-1", "me": "eu-central-1", "af": "eu-central-1", "il": "eu-central-1",
                     "ap": "ap-south-1"}
_DENIED = {"AccessDeniedException", "AccessDenied", "UnauthorizedOperation"}
_USE_CATALOG = "or use the catalog price: drop --live"


def price_list_region(region: str) -> str:
    """The Price List API endpoint nearest a region (the API answers for every region from any endpoint)."""
    return _NEAREST_ENDPOINT.get(region.split("-", 1)[0], "us-east-1")


def product_filters(instance_type: str, region: str) -> list[dict[str, str]]:
    """`get_products` filters that leave the one on-demand Linux, shared-tenancy product of a type in a region."""
    terms = {
        "ServiceCode": "AmazonEC2", "instanceType": instance_type, "regionCode": region,
        "operatingSystem": "Linux", "tenancy": "Shared", "preInstalledSw": "NA", "capacitystatus": "Used",
    }
    return [{"Type": "TERM_MATCH", "Field": field, "Value": value} for field, value in terms.items()]


def _unit_prices(product: dict[str, Any], unit: str) -> list[float]:
    prices = []
    for offer in (product.get("terms") or {}).get("OnDemand", {}).values():
        for dimension in (offer.get("priceDimensions") or {}).values():
            usd = (dimension.get("pricePerUnit") or {}).get("USD")
            if dimension.get("unit") == unit and usd is not None and float(usd) > 0:
                prices.append(float(usd))
    return prices


def on_demand_usd(price_list: list[str], unit: str = "Hrs", what: str = "the product") -> float:
    """The on-demand USD price per `unit` the PriceList states; an error when it states none, or several."""
    prices = sorted({p for item in price_list for p in _unit_prices(json.loads(item), unit)})
    if not prices:
        reason = "no product matches" if not price_list else f"no on-demand USD price per {unit}"
        raise TrainliftError(
            f"the AWS Price List API has no on-demand price for {what} ({reason})",
            hint="check the instance type and region; `trainlift capacity TYPE --region REGION` shows where "
                 "it is offered",
        )
    if len(prices) > 1:
        raise TrainliftError(
            f"the AWS Price List API states {len(prices)} different on-demand prices for {what} "
            f"({', '.join(f'${p:g}' for p in prices)})", hint=f"narrow the filters, {_USE_CATALOG}")
    return prices[0]


def publication_date(price_list: list[str]) -> date | None:
    """The day the price list was published, from its first product; None when it does not say."""
    for item in price_list:
        stamp = json.loads(item).get("publicationDate")
        if stamp:
            return datetime.fromisoformat(stamp.replace("Z", "+00:00")).date()
    return None


def price_api_error(exc: Exception, endpoint: str) -> TrainliftError | None:
    """The one-line error for a Price List API call that failed; None for an error this does not know."""
    from botocore import exceptions as bce

    api = f"the AWS Price List API ({endpoint})"
    if isinstance(exc, (bce.NoCredentialsError, bce.PartialCredentialsError)):
        return TrainliftError(f"{api} needs AWS credentials and none were found",
                              hint=f"{CREDENTIALS_HINT}; {_USE_CATALOG}")
    if isinstance(exc, (bce.EndpointConnectionError, bce.ConnectTimeoutError, bce.ReadTimeoutError)):
        return TrainliftError(f"cannot reach {api}: {exc}",
                              hint=f"check the network, the proxy and AWS_ENDPOINT_URL, {_USE_CATALOG}")
    if isinstance(exc, bce.ClientError) and error_code(exc) in REJECTED_CODES:
        return TrainliftError(f"{api} rejected the credentials ({error_code(exc)}: {error_message(exc)})",
                              hint=f"{CREDENTIALS_HINT}; {_USE_CATALOG}")
    if isinstance(exc, bce.ClientError) and error_code(exc) in _DENIED:
        return TrainliftError(f"{api} denied pricing:GetProducts ({error_message(exc)})",
                              hint=f"allow pricing:GetProducts for these credentials, {_USE_CATALOG}")
    if isinstance(exc, bce.ClientError):
        return TrainliftError(f"{api} failed: {error_code(exc)}: {error_message(exc)}", hint=_USE_CATALOG)
    return None
