"""IAM's evaluation rules, checked on AWS's own documented examples and the outcomes the documentation states.

Each example names the page it comes from (AWS IAM User Guide; Amazon S3 User Guide). Principal elements of the
bucket-policy examples are left out: the evaluator judges the caller's own (identity) policy. Pure.
"""

from __future__ import annotations

import pytest

from trainlift.render.iam_eval import PolicyError, arn_like, evaluate, make_request


def policy(*statements: dict) -> dict:
    return {"Version": "2012-10-17", "Statement": list(statements)}


def effect(doc: dict, action: str, resource: str, **keys) -> str:
    return evaluate(doc, make_request(action, resource, {k.replace("__", ":"): v for k, v in keys.items()})).effect


# --- IAM User Guide, "Policy evaluation logic": "Determining whether a request is allowed or denied within an
# account": requests are implicitly denied by default; an explicit allow overrides that; an explicit deny in any
# policy overrides any allows.

def test_policy_evaluation_logic_default_deny_allow_and_deny_over_allow():
    allow = {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/*"}
    deny = {"Effect": "Deny", "Action": "s3:*", "Resource": "arn:aws:s3:::b/secret/*"}
    assert effect(policy(), "s3:GetObject", "arn:aws:s3:::b/x") == "ImplicitDeny"
    assert effect(policy(allow), "s3:GetObject", "arn:aws:s3:::b/x") == "Allow"
    assert effect(policy(allow, deny), "s3:GetObject", "arn:aws:s3:::b/secret/x") == "Deny"
    assert effect(policy(deny, allow), "s3:GetObject", "arn:aws:s3:::b/secret/x") == "Deny"  # order is irrelevant
    assert effect(policy(allow), "s3:PutObject", "arn:aws:s3:::b/x") == "ImplicitDeny"
    assert effect(policy(allow), "S3:getobject", "arn:aws:s3:::b/x") == "Allow"  # action names ignore case


# --- IAM User Guide, "IAM JSON policy elements: Condition operators".

def test_condition_operators_important_a_missing_key_is_false_but_true_for_a_negated_operator():
    """"If the key that you specify in a policy condition is not present in the request context, the values do not
    match and the condition is false. If the policy condition requires that the key is not matched, such as
    StringNotLike or ArnNotLike, and the right key is not present, the condition is true.\""""
    like = policy({"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::b",
                   "Condition": {"StringLike": {"s3:prefix": "home/*"}}})
    not_like = policy({"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::b",
                       "Condition": {"StringNotLike": {"s3:prefix": "home/*"}}})
    arn_not_like = policy({"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::b",
                           "Condition": {"ArnNotLike": {"aws:SourceArn": "arn:aws:sns:*:*:t"}}})
    assert effect(like, "s3:ListBucket", "arn:aws:s3:::b") == "ImplicitDeny"
    assert effect(not_like, "s3:ListBucket", "arn:aws:s3:::b") == "Allow"
    assert effect(arn_not_like, "s3:ListBucket", "arn:aws:s3:::b") == "Allow"


def test_condition_operators_string_example_home_directory_with_a_policy_variable():
    """The StringLike example: the S3 console's "home directory" policy, with ${aws:username}."""
    doc = policy(
        {"Effect": "Allow", "Action": ["s3:ListAllMyBuckets", "s3:GetBucketLocation"], "Resource": "arn:aws:s3:::*"},
        {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::BUCKET-NAME",
         "Condition": {"StringLike": {"s3:prefix": ["", "home/", "home/${aws:username}/"]}}},
        {"Effect": "Allow", "Action": "s3:*", "Resource": ["arn:aws:s3:::BUCKET-NAME/home/${aws:username}",
                                                             "arn:aws:s3:::BUCKET-NAME/home/${aws:username}/*"]})
    bucket = "arn:aws:s3:::BUCKET-NAME"
    assert effect(doc, "s3:ListBucket", bucket, aws__username="bob", s3__prefix="home/bob/") == "Allow"
    assert effect(doc, "s3:ListBucket", bucket, aws__username="bob", s3__prefix="") == "Allow"
    assert effect(doc, "s3:ListBucket", bucket, aws__username="bob", s3__prefix="home/alice/") == "ImplicitDeny"
    assert effect(doc, "s3:PutObject", bucket + "/home/bob/notes.txt", aws__username="bob") == "Allow"
    assert effect(doc, "s3:PutObject", bucket + "/home/alice/notes.txt", aws__username="bob") == "ImplicitDeny"
    # A variable whose key the request lacks matches nothing.
    assert effect(doc, "s3:PutObject", bucket + "/home/bob/notes.txt") == "ImplicitDeny"


def test_condition_operators_numeric_example_s3_max_keys():
    doc = policy({"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::example_bucket",
                  "Condition": {"NumericLessThanEquals": {"s3:max-keys": "10"}}})
    assert effect(doc, "s3:ListBucket", "arn:aws:s3:::example_bucket", **{"s3__max-keys": "10"}) == "Allow"
    assert effect(doc, "s3:ListBucket", "arn:aws:s3:::example_bucket", **{"s3__max-keys": "1000"}) == "ImplicitDeny"


def test_condition_operators_bool_example_deny_without_secure_transport():
    doc = policy({"Sid": "BooleanExample", "Action": "s3:*", "Effect": "Deny",
                  "Resource": ["arn:aws:s3:::DOC-EXAMPLE-BUCKET", "arn:aws:s3:::DOC-EXAMPLE-BUCKET/*"],
                  "Condition": {"Bool": {"aws:SecureTransport": "false"}}},
                 {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "*"})
    obj = "arn:aws:s3:::DOC-EXAMPLE-BUCKET/x"
    assert effect(doc, "s3:GetObject", obj, aws__SecureTransport="false") == "Deny"
    assert effect(doc, "s3:GetObject", obj, aws__SecureTransport="true") == "Allow"


def test_condition_operators_arn_example_stringlike_matches_where_arnlike_does_not():
    pattern = "arn:aws:someservice:*:111122223333:finance/*"
    value = "arn:aws:someservice:us-east-2:999999999999:store/abc:111122223333:finance/document.txt"
    string_like = policy({"Effect": "Allow", "Action": "x:Y", "Resource": "*",
                          "Condition": {"StringLike": {"aws:SourceArn": pattern}}})
    arn_like_doc = policy({"Effect": "Allow", "Action": "x:Y", "Resource": "*",
                           "Condition": {"ArnLike": {"aws:SourceArn": pattern}}})
    assert effect(string_like, "x:Y", "r", aws__SourceArn=value) == "Allow"
    assert effect(arn_like_doc, "x:Y", "r", aws__SourceArn=value) == "ImplicitDeny"
    assert not arn_like(pattern, value)


def test_condition_operators_ifexists_example_run_instances():
    does_not_work = policy({"Sid": "THISPOLICYDOESNOTWORK", "Effect": "Allow", "Action": "ec2:RunInstances",
                            "Resource": "*", "Condition": {"StringLike": {"ec2:InstanceType": ["t1.*", "t2.*", "m3.*"]}}})
    works = policy({"Sid": "RunInstance", "Effect": "Allow", "Action": "ec2:RunInstances", "Resource": "*",
                    "Condition": {"StringLikeIfExists": {"ec2:InstanceType": ["t1.*", "t2.*", "m3.*"]}}})
    image = "arn:aws:ec2:us-east-1::image/ami-1"  # a resource without the key
    instance = "arn:aws:ec2:us-east-1:111122223333:instance/*"
    assert effect(does_not_work, "ec2:RunInstances", image) == "ImplicitDeny"
    assert effect(works, "ec2:RunInstances", image) == "Allow"
    assert effect(works, "ec2:RunInstances", instance, ec2__InstanceType="t2.micro") == "Allow"
    assert effect(works, "ec2:RunInstances", instance, ec2__InstanceType="p5.48xlarge") == "ImplicitDeny"


def test_condition_operators_ifexists_a_deny_with_a_negated_operator_still_denies_when_the_key_is_missing():
    doc = policy({"Effect": "Allow", "Action": "s3:PutObject", "Resource": "*"},
                 {"Effect": "Deny", "Action": "s3:PutObject", "Resource": "*",
                  "Condition": {"StringNotEqualsIfExists": {"aws:RequestTag/team": "ml"}}})
    assert effect(doc, "s3:PutObject", "arn:aws:s3:::b/k") == "Deny"
    assert effect(doc, "s3:PutObject", "arn:aws:s3:::b/k", **{"aws__RequestTag/team": "ml"}) == "Allow"


def test_condition_operators_null_example_token_issue_time():
    doc = policy({"Action": "ec2:*", "Effect": "Allow", "Resource": "*",
                  "Condition": {"Null": {"aws:TokenIssueTime": "true"}}})
    assert effect(doc, "ec2:DescribeInstances", "*") == "Allow"  # access keys: the key is absent
    assert effect(doc, "ec2:DescribeInstances", "*", aws__TokenIssueTime="2020-01-01T00:00:01Z") == "ImplicitDeny"


# --- IAM User Guide, "Conditions with multiple context keys or values" (set operators).

REQUESTED = "dynamodb:requestedAttributes"


def test_multiple_values_forallvalues_example():
    doc = policy({"Effect": "Allow", "Action": "dynamodb:GetItem", "Resource": "*",
                  "Condition": {"ForAllValues:StringLike": {REQUESTED: ["PostDateTime", "Message", "Tags"]}}})
    get = lambda *attrs: evaluate(doc, make_request("dynamodb:GetItem", "t", {REQUESTED: list(attrs)})).effect
    assert get("PostDateTime", "Message") == "Allow"
    assert get("PostDateTime", "UserName") == "ImplicitDeny"
    assert get() == "Allow"  # an empty data set: ForAllValues is true


def test_multiple_values_foranyvalue_deny_example():
    doc = policy({"Effect": "Allow", "Action": "dynamodb:PutItem", "Resource": "*"},
                 {"Effect": "Deny", "Action": "dynamodb:PutItem", "Resource": "*",
                  "Condition": {"ForAnyValue:StringLike": {REQUESTED: ["ID", "PostDateTime"]}}})
    put = lambda *attrs: evaluate(doc, make_request("dynamodb:PutItem", "t", {REQUESTED: list(attrs)})).effect
    assert put("UserName", "Message", "PostDateTime") == "Deny"
    assert put("UserName") == "Allow"
    assert put() == "Allow"  # an empty data set: ForAnyValue is false, the Deny does not apply


# --- Amazon S3 User Guide, "Amazon S3 condition keys" / "Example bucket policies using condition keys".

def test_s3_bucket_example_2_listing_only_a_prefix_with_an_explicit_deny():
    """"Getting a list of objects in a bucket with a specific prefix": Allow StringEquals s3:prefix projects, and
    Deny StringNotEquals. A list without that prefix is explicitly denied; so is HeadBucket, which carries no
    s3:prefix (a negated operator on a missing key is true)."""
    doc = policy({"Sid": "statement1", "Effect": "Allow", "Action": "s3:ListBucket",
                  "Resource": "arn:aws:s3:::awsexamplebucket1",
                  "Condition": {"StringEquals": {"s3:prefix": "projects"}}},
                 {"Sid": "statement2", "Effect": "Deny", "Action": "s3:ListBucket",
                  "Resource": "arn:aws:s3:::awsexamplebucket1",
                  "Condition": {"StringNotEquals": {"s3:prefix": "projects"}}})
    bucket = "arn:aws:s3:::awsexamplebucket1"
    assert effect(doc, "s3:ListBucket", bucket, s3__prefix="projects") == "Allow"
    denied = evaluate(doc, make_request("s3:ListBucket", bucket, {"s3:prefix": "examplefolder"}))
    assert (denied.effect, denied.statement) == ("Deny", 1)
    assert effect(doc, "s3:ListBucket", bucket) == "Deny"


def test_s3_prefix_conditioned_listing_denies_headbucket_implicitly():
    """The shape trainlift rendered before: StringLike s3:prefix only. HeadBucket (no s3:prefix) is not allowed,
    and the decision names the statement and the missing key."""
    doc = policy({"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::b",
                  "Condition": {"StringLike": {"s3:prefix": ["runs", "runs/*"]}}})
    assert effect(doc, "s3:ListBucket", "arn:aws:s3:::b", s3__prefix="runs/x/") == "Allow"
    assert effect(doc, "s3:ListBucket", "arn:aws:s3:::b", s3__prefix="other/") == "ImplicitDeny"
    head = evaluate(doc, make_request("s3:ListBucket", "arn:aws:s3:::b"))
    assert head.effect == "ImplicitDeny"
    assert head.near == ("statement 1 allows it only with StringLike s3:prefix ['runs', 'runs/*'], and the request "
                         "has no s3:prefix",)


def test_s3_object_example_3_copy_source_restricted_by_a_deny():
    doc = policy({"Effect": "Allow", "Action": "s3:PutObject", "Resource": "arn:aws:s3:::awsexamplebucket1/*"},
                 {"Effect": "Deny", "Action": "s3:PutObject", "Resource": "arn:aws:s3:::awsexamplebucket1/*",
                  "Condition": {"StringNotLike": {"s3:x-amz-copy-source": "awsexamplebucket1/public/*"}}})
    obj = "arn:aws:s3:::awsexamplebucket1/HappyFace.jpg"
    assert effect(doc, "s3:PutObject", obj, **{"s3__x-amz-copy-source": "awsexamplebucket1/public/a.jpg"}) == "Allow"
    assert effect(doc, "s3:PutObject", obj, **{"s3__x-amz-copy-source": "examplebucket/private/a.jpg"}) == "Deny"


def test_s3_object_example_4_one_version_only():
    doc = policy({"Sid": "statement1", "Effect": "Allow", "Action": "s3:GetObjectVersion",
                  "Resource": "arn:aws:s3:::examplebucketversionenabled/HappyFace.jpg"},
                 {"Sid": "statement2", "Effect": "Deny", "Action": "s3:GetObjectVersion",
                  "Resource": "arn:aws:s3:::examplebucketversionenabled/HappyFace.jpg",
                  "Condition": {"StringNotEquals": {"s3:VersionId": "AaaHbAQitwiL_h47_44lRO2DDfLlBO5e"}}})
    obj = "arn:aws:s3:::examplebucketversionenabled/HappyFace.jpg"
    assert effect(doc, "s3:GetObjectVersion", obj, s3__VersionId="AaaHbAQitwiL_h47_44lRO2DDfLlBO5e") == "Allow"
    assert effect(doc, "s3:GetObjectVersion", obj, s3__VersionId="other") == "Deny"


def test_s3_bucket_example_1_create_bucket_in_one_region():
    doc = policy({"Sid": "statement1", "Effect": "Allow", "Action": "s3:CreateBucket", "Resource": "arn:aws:s3:::*",
                  "Condition": {"StringLike": {"s3:LocationConstraint": "sa-east-1"}}},
                 {"Sid": "statement2", "Effect": "Deny", "Action": "s3:CreateBucket", "Resource": "arn:aws:s3:::*",
                  "Condition": {"StringNotLike": {"s3:LocationConstraint": "sa-east-1"}}})
    assert effect(doc, "s3:CreateBucket", "arn:aws:s3:::mine", s3__LocationConstraint="sa-east-1") == "Allow"
    assert effect(doc, "s3:CreateBucket", "arn:aws:s3:::mine", s3__LocationConstraint="us-east-2") == "Deny"


# --- matching details

def test_resource_wildcards_and_the_not_forms():
    assert arn_like("arn:aws:s3:::b/runs/*", "arn:aws:s3:::b/runs/a/b:c")  # a key may hold '/' and ':'
    assert not arn_like("arn:aws:s3:::b/runs/*", "arn:aws:s3:::b/runs")
    assert not arn_like("arn:aws:s3:::b/runs/*", "arn:aws:s3:::b/runs-old/x")
    assert arn_like("arn:aws:s3:::b/run?/x", "arn:aws:s3:::b/runs/x")
    assert not arn_like("arn:aws:s3:::b/*", "arn:aws-cn:s3:::b/x")
    doc = policy({"Effect": "Allow", "NotAction": "s3:Delete*", "NotResource": "arn:aws:s3:::b/keep/*"})
    assert effect(doc, "s3:GetObject", "arn:aws:s3:::b/x") == "Allow"
    assert effect(doc, "s3:DeleteObject", "arn:aws:s3:::b/x") == "ImplicitDeny"
    assert effect(doc, "s3:GetObject", "arn:aws:s3:::b/keep/x") == "ImplicitDeny"


def test_operators_it_does_not_model_are_refused_by_name():
    doc = policy({"Effect": "Allow", "Action": "s3:*", "Resource": "*",
                  "Condition": {"IpAddress": {"aws:SourceIp": "203.0.113.0/24"}}})
    with pytest.raises(PolicyError, match="IpAddress is not modelled"):
        evaluate(doc, make_request("s3:GetObject", "arn:aws:s3:::b/x", {"aws:SourceIp": "203.0.113.5"}))


def test_a_variable_in_an_arn_part_is_replaced_before_the_parts_are_matched():
    pattern = "arn:aws:iam::${aws:PrincipalAccount}:user/*"
    assert arn_like(pattern, "arn:aws:iam::111122223333:user/bob", {"aws:principalaccount": ("111122223333",)})
    assert not arn_like(pattern, "arn:aws:iam::999999999999:user/bob", {"aws:principalaccount": ("111122223333",)})
