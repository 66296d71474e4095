"""libs.admin: the admin API client that the CLI, the benchmarks and the tests deploy models with."""

import json
from pathlib import Path

import httpx
import pytest

from libs.admin import client
from libs.cluster.launcher import ClusterError


def gateway(monkeypatch, answers: dict[tuple[str, str], httpx.Response]) -> list[tuple[str, str, dict, dict]]:
    """httpx.request answered by (method, url) from ANSWERS; returns the calls made."""
    calls = []

    def request(method, url, json=None, params=None, timeout=None, headers=None):
        calls.append((method, url, json, headers))
        return answers[method, url]
    monkeypatch.setattr(client.httpx, "request", request)
    return calls


def answer(status: int, body: dict) -> httpx.Response:
    return httpx.Response(status, content=json.dumps(body), headers={"content-type": "application/json"})


def test_deploy_posts_the_model_with_the_admin_key(monkeypatch, tmp_path):
    calls = gateway(monkeypatch, {("POST", "http://gw/admin/v1/models"): answer(201, {"name": "m"})})
    assert client.deploy_model(("http://gw/", "sk-admin"), "m", tmp_path, max_instances=2) == {"name": "m"}
    (method, url, body, headers), = calls
    assert headers == {"Authorization": "Bearer sk-admin"}
    assert body["name"] == "m" and body["path"] == str(Path(tmp_path).resolve()) and body["max_instances"] == 2


def test_deploy_of_a_model_already_there_returns_it(monkeypatch, tmp_path):
    gateway(monkeypatch, {("POST", "http://gw/admin/v1/models"): answer(409, {"error": {"message": "exists"}}),
                          ("GET", "http://gw/admin/v1/models/m"): answer(200, {"name": "m", "blocks": []})})
    assert client.deploy_model(("http://gw", "k"), "m", tmp_path) == {"name": "m", "blocks": []}


def test_a_refused_deploy_raises_the_gateways_message(monkeypatch, tmp_path):
    gateway(monkeypatch, {("POST", "http://gw/admin/v1/models"): answer(400, {"error": {"message": "bad policy"}})})
    with pytest.raises(ClusterError, match="bad policy"):
        client.deploy_model(("http://gw", "k"), "m", tmp_path, policy="nope")
