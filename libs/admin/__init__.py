"""A client of the gateway's admin API (/admin/v1/...): what the CLI, the benchmarks and the tests
use to deploy models on a cluster. A library, so that none of them imports the CLI."""

from libs.admin.client import AdminTarget, admin_request, deploy_model

__all__ = ["AdminTarget", "admin_request", "deploy_model"]
