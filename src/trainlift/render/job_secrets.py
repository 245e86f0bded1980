"""Whether the cluster's pods get the credentials a job needs: the MLflow Secret named by run.mlflow_secret must
reach the pods' environment through the cluster spec's `secrets` (the pods are made from the cluster spec, so
that is the one place their environment comes from)."""

from __future__ import annotations

from trainlift.config.cluster import ClusterSpec
from trainlift.config.job import JobSpec
from trainlift.render.problems import Problem

TOKEN = "MLFLOW_TRACKING_TOKEN"
USER_AND_PASSWORD = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
CREDENTIAL_ENV = (TOKEN, *USER_AND_PASSWORD)


def mlflow_secret_problems(cluster: ClusterSpec, job: JobSpec) -> list[Problem]:
    secret = job.run.mlflow_secret
    if secret is None:
        return []
    filled = {ref.env for ref in cluster.secrets if ref.secret == secret}
    if TOKEN in filled or set(USER_AND_PASSWORD) <= filled:
        return []
    snippet = f"{{env: {TOKEN}, secret: {secret}, key: {TOKEN}}}"
    return [Problem("run.mlflow_secret",
                    f"the cluster's pods do not read MLflow credentials from Secret {secret} (the cluster spec's "
                    f"secrets fill {', '.join(sorted(filled)) or 'nothing'} from it)",
                    hint=f"add to the cluster spec's secrets: {snippet} (or _USERNAME and _PASSWORD), then "
                    "`trainlift cluster up` again")]
