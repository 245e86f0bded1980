"""IAM's decision on one request against one identity policy. Pure.

The rules are the IAM User Guide's ("Policy evaluation logic", "IAM JSON policy elements: Condition operators",
"Conditions with multiple context keys or values"): a request is denied unless a statement allows it, and an
applicable Deny wins over every Allow. A statement applies when its Action (or NotAction) matches, its Resource
(or NotResource) matches, and every condition in it holds: operators are ANDed, keys under one operator are ANDed,
the values listed for a key are ORed (NORed for a negated operator). A condition on a key the request does not
carry is false, except a negated operator (`StringNotLike`, `ArnNotEquals`, ...), which is true, `...IfExists`,
which is true, and `Null`, which tests just that; `ForAllValues:` is true and `ForAnyValue:` false on an absent or
empty key.

Matching: actions ignore case and take `*` and `?`; resources and `...Like` values take `*` and `?` anywhere
(an ARN pattern matches each of the six colon-separated parts on its own); condition key names ignore case.
Policy variables (`${aws:username}`, `${key, 'default'}`, and the escapes `${*}`, `${?}`, `${$}`) are replaced
from the request; a variable whose key the request lacks matches nothing. Principal is not read: the policy is
the caller's own. Date, IP address and binary operators are refused by name (`PolicyError`), never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

Context = Mapping[str, tuple[str, ...]]  # condition key (lower case) -> the request's values


class PolicyError(ValueError):
    """A policy this module cannot judge faithfully (an operator it does not model)."""


@dataclass(frozen=True)
class Request:
    action: str  # "s3:ListBucket"
    resource: str  # "arn:aws:s3:::bucket" or "arn:aws:s3:::bucket/key"
    context: Context = field(default_factory=dict)


def make_request(action: str, resource: str, keys: Mapping[str, str | list[str]] | None = None) -> Request:
    """A Request from condition keys as IAM names them (`{"s3:prefix": "runs/"}`); a key left out is absent."""
    given = keys or {}
    return Request(action, resource, {k.lower(): (v,) if isinstance(v, str) else tuple(v) for k, v in given.items()})


@dataclass(frozen=True)
class Decision:
    effect: str  # "Allow", "Deny" (an explicit Deny) or "ImplicitDeny" (no statement allows it)
    statement: int | None = None  # the deciding statement's index (Allow, Deny)
    near: tuple[str, ...] = ()  # ImplicitDeny: Allow statements that matched action and resource, and why not

    @property
    def allowed(self) -> bool:
        return self.effect == "Allow"


def listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def statements(policy: Mapping[str, Any]) -> list[dict[str, Any]]:
    return listed(policy.get("Statement", []))


def statement_name(policy: Mapping[str, Any], index: int) -> str:
    sid = statements(policy)[index].get("Sid")
    return f"statement {index + 1}" + (f" ({sid})" if sid else "")


# --- patterns -------------------------------------------------------------------------------------------------

_VARIABLE = re.compile(r"\$\{([^}]*)\}")
_ESCAPES = {"*": "*", "?": "?", "$": "$"}
_OUTSIDE_VARIABLES = re.compile(r":(?![^{]*\})")  # a colon that is not inside ${...}


def _pattern(text: str, context: Context, wildcards: bool, ignore_case: bool = False) -> re.Pattern[str] | None:
    """`text` as an anchored regex: variables replaced (None when one's key is absent), `*`/`?` as wildcards."""
    parts, at = [], 0
    for found in _VARIABLE.finditer(text):
        parts.append(_glob(text[at:found.start()], wildcards))
        name, _, default = found.group(1).partition(",")
        if name.strip() in _ESCAPES:
            parts.append(re.escape(_ESCAPES[name.strip()]))
        else:
            values = context.get(name.strip().lower())
            value = values[0] if values else default.strip().strip("'") if default else None
            if value is None:
                return None
            parts.append(re.escape(value))
        at = found.end()
    parts.append(_glob(text[at:], wildcards))
    return re.compile("".join(parts), re.DOTALL | (re.IGNORECASE if ignore_case else 0))


def _glob(text: str, wildcards: bool) -> str:
    if not wildcards:
        return re.escape(text)
    return "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in text)


def _like(pattern: str, value: str, context: Context, wildcards: bool = True, ignore_case: bool = False) -> bool:
    compiled = _pattern(pattern, context, wildcards, ignore_case)
    return compiled is not None and compiled.fullmatch(value) is not None


def arn_like(pattern: str, arn: str, context: Context | None = None) -> bool:
    """ArnLike / Resource matching: each of the six colon-separated parts on its own (the last takes the rest)."""
    context = context or {}
    if pattern == "*":
        return True
    wanted, have = _OUTSIDE_VARIABLES.split(pattern, maxsplit=5), arn.split(":", 5)
    if len(wanted) != 6 or len(have) != 6:
        return _like(pattern, arn, context)
    return all(_like(w, h, context) for w, h in zip(wanted, have))


def action_matches(pattern: str, action: str) -> bool:
    return _like(pattern, action, {}, ignore_case=True)


# --- conditions -----------------------------------------------------------------------------------------------

def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")  # a non-number never compares true


_NUMERIC: dict[str, Callable[[float, float], bool]] = {
    "Equals": lambda a, b: a == b, "LessThan": lambda a, b: a < b, "LessThanEquals": lambda a, b: a <= b,
    "GreaterThan": lambda a, b: a > b, "GreaterThanEquals": lambda a, b: a >= b,
}


def _positive(operator: str) -> Callable[[str, str, Context], bool] | None:
    """One request value against one policy value, for the operator without its negation."""
    if operator in ("StringEquals", "StringEqualsIgnoreCase", "StringLike"):
        return lambda want, have, ctx: _like(want, have, ctx, wildcards=operator == "StringLike",
                                             ignore_case=operator.endswith("IgnoreCase"))
    if operator in ("ArnEquals", "ArnLike"):
        return lambda want, have, ctx: arn_like(want, have, ctx)
    if operator == "Bool":
        return lambda want, have, ctx: str(want).lower() == have.lower()
    if operator.startswith("Numeric") and operator[len("Numeric"):] in _NUMERIC:
        compare = _NUMERIC[operator[len("Numeric"):]]
        return lambda want, have, ctx: compare(_number(have), _number(str(want)))
    return None


_NEGATED = {"StringNotEquals": "StringEquals", "StringNotEqualsIgnoreCase": "StringEqualsIgnoreCase",
            "StringNotLike": "StringLike", "ArnNotEquals": "ArnEquals", "ArnNotLike": "ArnLike",
            "NumericNotEquals": "NumericEquals"}


def condition_holds(operator: str, key: str, wanted: Any, context: Context) -> bool:
    """One `"Operator": {"key": values}` entry of a Condition block against the request's context."""
    qualifier, _, operator = operator.rpartition(":")
    if_exists = operator.endswith("IfExists") and operator != "IfExists"
    base = operator[: -len("IfExists")] if if_exists else operator
    values = context.get(key.lower())
    if base == "Null":
        return any((values is None) == (str(w).lower() == "true") for w in listed(wanted))
    negated = base in _NEGATED
    test = _positive(_NEGATED.get(base, base))
    if test is None:
        raise PolicyError(f"condition operator {operator} is not modelled (date, IP address and binary "
                          "operators are not); judge this policy with IAM's policy simulator")
    if not values:
        return {"ForAllValues": True, "ForAnyValue": False}.get(qualifier, if_exists or negated)

    def one(value: str) -> bool:
        hit = any(test(str(w), value, context) for w in listed(wanted))
        return not hit if negated else hit

    return all(one(v) for v in values) if qualifier == "ForAllValues" else any(one(v) for v in values)


def failed_condition(statement: Mapping[str, Any], context: Context) -> str | None:
    """None when every condition of the statement holds; else the first that does not and what the request has."""
    for operator, entries in (statement.get("Condition") or {}).items():
        for key, wanted in entries.items():
            if not condition_holds(operator, key, wanted, context):
                have = context.get(key.lower())
                carried = f"the request's {key} is {', '.join(have)}" if have else f"the request has no {key}"
                return f"{operator} {key} {listed(wanted)}, and {carried}"
    return None


# --- statements and the decision ------------------------------------------------------------------------------

def _covers(statement: Mapping[str, Any], req: Request) -> bool:
    """Action and Resource (or their Not- forms) match the request."""
    if "NotAction" in statement:
        acts = not any(action_matches(a, req.action) for a in listed(statement["NotAction"]))
    else:
        acts = any(action_matches(a, req.action) for a in listed(statement.get("Action", [])))
    if "NotResource" in statement:
        return acts and not any(arn_like(r, req.resource, req.context) for r in listed(statement["NotResource"]))
    return acts and any(arn_like(r, req.resource, req.context) for r in listed(statement.get("Resource", [])))


def evaluate(policy: Mapping[str, Any], req: Request) -> Decision:
    """IAM's decision for `req` under `policy`: an applicable Deny, else an applicable Allow, else ImplicitDeny."""
    allow, near = None, []
    for index, statement in enumerate(statements(policy)):
        if not _covers(statement, req):
            continue
        why_not = failed_condition(statement, req.context)
        if statement.get("Effect") == "Deny":
            if why_not is None:
                return Decision("Deny", index)
        elif why_not is None:
            allow = index if allow is None else allow
        else:
            near.append(f"{statement_name(policy, index)} allows it only with {why_not}")
    return Decision("Allow", allow) if allow is not None else Decision("ImplicitDeny", near=tuple(near))
