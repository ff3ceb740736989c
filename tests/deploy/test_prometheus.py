"""The shipped monitoring files against live data: two real servers, the real ``prometheus``
binary scraping them with a config derived from deploy/prometheus/prometheus.yml (its
commented API-key block uncommented), real traffic (length and stop finishes, streamed and
not, shared prefixes, a KV cache small enough to preempt), then every PromQL expression of
deploy/grafana/vllm_lite.json through Prometheus's HTTP query API: each must succeed with a
non-empty, finite result, per-replica series must show both replicas and summed ones none.

Skips where the prometheus binary is missing (Debian: ``apt-get install prometheus``); the
dashboard's structure is checked without it."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "vllm_lite.json"
PROVISIONING = DEPLOY / "grafana" / "provisioning"

API_KEY = "prometheus-test-key"
SCRAPE_S = 1
# What the test puts for Grafana's $__rate_interval: it must cover the whole traffic phase
# (so quantiles are finite) and hold >= 4 scrapes, like Grafana's own minimum.
RATE_WINDOW = "30s"
TRAFFIC_S = 6.0  # >= 5 scrapes while requests run: rates see several increments
CLIENTS_PER_SERVER = 4
# 24 blocks of 4 tokens: 4 concurrent requests of ~43 tokens (19 prompt + 24 output) need
# ~44 blocks, so the scheduler preempts (the Preemptions panel gets real data).
KV_BLOCKS = 24
# 15 tokens, 3 full KV blocks shared by every prompt (prefix cache hits); prompt +
# max_tokens stay well under the 96-token pool (a request that can never fit ends in an
# error).
SHARED_PREFIX = "Shared prefix: "
# Series that Prometheus makes itself (not in a server's /metrics).
PROMETHEUS_MADE = {"up"}

# The metric families the dashboard shows.
REQUIRED_METRICS = {
    "vllm_lite:generation_tokens_total", "vllm_lite:prompt_tokens_total",
    "vllm_lite:num_requests_running", "vllm_lite:num_requests_waiting",
    "vllm_lite:num_requests_swapped", "vllm_lite:gpu_cache_usage_perc",
    "vllm_lite:gpu_prefix_cache_hit_rate", "vllm_lite:num_preemptions_total",
    "vllm_lite:time_to_first_token_seconds_bucket",
    "vllm_lite:time_per_output_token_seconds_bucket",
    "vllm_lite:e2e_request_latency_seconds_bucket", "vllm_lite:request_success_total",
}
HISTOGRAMS = ("time_to_first_token_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds")

_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
_RANGE = re.compile(r"\[([^\]]+)\]")
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


# -- the dashboard as data -----------------------------------------------------------------------
def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _targets(dash: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) of every panel, rows' nested panels included."""
    out = []
    for panel in _panels(dash):
        for t in panel.get("targets", []):
            out.append((panel["title"], t))
    return out


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    panels = []
    for p in dash["panels"]:
        if p.get("type") == "row":
            panels.extend(p.get("panels", []))  # a collapsed row holds its panels
        else:
            panels.append(p)
    return panels


def _metric_names(expr: str) -> set[str]:
    return {m.group(1) for m in _SELECTOR.finditer(expr)}


def _grafana_regex_escape(value: str) -> str:
    """How Grafana's Prometheus datasource writes one value of a multi-value variable into
    a =~ matcher: regex specials backslash-escaped, the backslash doubled for the PromQL
    string literal."""
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\\\1", value)


def _substitute(expr: str, values: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return values.get(name, m.group(0))

    return _VARIABLE.sub(repl, expr)


# -- structure (no Prometheus needed) -------------------------------------------------------------
def test_dashboard_structure() -> None:
    dash = _dashboard()
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "model_name"):
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["multi"], name
        assert v["datasource"]["uid"] == "${datasource}", name
        assert v["definition"].startswith("label_values(") and v["definition"].endswith(
            f", {name})"), v["definition"]
        assert v["query"]["query"] == v["definition"], name
    # "All" must not become .* for instance: the `up` stat would count other jobs' targets.
    assert "allValue" not in variables["instance"]

    panels = _panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)), "duplicate panel titles"
    for p in panels:
        where = f"panel {p['title']!r}"
        exprs = [t.get("expr", "").strip() for t in p.get("targets", [])]
        assert exprs and all(exprs), f"{where}: every panel needs targets with an expr"
        assert p["datasource"]["uid"] == "${datasource}", where
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), f"{where}: duplicate refIds"
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, where
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", where
            expr = t["expr"]
            assert expr.count("(") == expr.count(")"), f"{where}: unbalanced {expr}"
            # Windows follow the dashboard (zoom, scrape interval), never a fixed one.
            for window in _RANGE.findall(expr):
                assert window in ("$__rate_interval", "$__range"), f"{where}: [{window}]"
            for metric, matchers in _SELECTOR.findall(expr):
                assert 'instance=~"$instance"' in matchers, f"{where}: {metric} unfiltered"
                if metric.startswith("vllm_lite:"):
                    assert 'model_name=~"$model_name"' in matchers, f"{where}: {metric}"
            # A legend naming the replica goes with a query that keeps the label.
            if "{{instance}}" in t.get("legendFormat", ""):
                assert re.search(r"by \((le, )?instance\b", expr), f"{where}: {expr}"

    exprs = [t["expr"] for _, t in _targets(dash)]
    used = set().union(*(_metric_names(e) for e in exprs))
    assert REQUIRED_METRICS <= used, f"not on the dashboard: {REQUIRED_METRICS - used}"
    for h in HISTOGRAMS:
        found = set()
        for e in exprs:
            for q, by in re.findall(r"histogram_quantile\((0\.\d+), sum by \(([^)]*)\) "
                                    rf"\(rate\(vllm_lite:{h}_bucket\{{", e):
                found.add((q, by))
        want = {(q, by) for q in ("0.5", "0.95", "0.99") for by in ("le", "le, instance")}
        assert found == want, f"{h}: {sorted(found)}"


def test_provisioning_points_at_the_dashboard() -> None:
    ds = yaml.safe_load((PROVISIONING / "datasources" / "vllm_lite.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")
    # $__rate_interval is derived from it: it has to be the shipped scrape_interval.
    shipped = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert source["jsonData"]["timeInterval"] == shipped["global"]["scrape_interval"]
    dashboards = yaml.safe_load((PROVISIONING / "dashboards" / "vllm_lite.yml").read_text())
    (provider,) = dashboards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_shipped_prometheus_config_is_valid(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH (Debian: apt-get install prometheus)")
    _promtool_check(promtool, PROMETHEUS_YML)
    # The commented API-key block, uncommented, is a valid config too.
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY)
    config["scrape_configs"][0].update(_auth_block(key_file))
    derived = tmp_path / "prometheus.yml"
    derived.write_text(yaml.safe_dump(config))
    _promtool_check(promtool, derived)


def _promtool_check(promtool: str, path: Path) -> None:
    r = subprocess.run([promtool, "check", "config", str(path)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


def _auth_block(key_file: Path) -> dict[str, Any]:
    """The shipped config's commented ``authorization:`` block, uncommented, with the key
    file replaced: the test scrapes through exactly what the comment tells users to do."""
    lines = PROMETHEUS_YML.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# authorization:")
    indent = lines[start].index("#")
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith(" " * indent + "#   "):
            break
        block.append(line)
    text = "\n".join(line[:indent] + line[indent + 2:] for line in block)
    auth = yaml.safe_load(text)
    assert set(auth) == {"authorization"}, text
    a = auth["authorization"]
    assert a["type"] == "Bearer" and "credentials_file" in a, text
    a["credentials_file"] = str(key_file)
    return auth


# -- live: two servers, Prometheus, traffic ----------------------------------------------------------
@dataclass
class Live:
    prom_url: str
    instances: list[str]  # host:port, Prometheus's instance label
    metrics: dict[str, str]  # instance -> /metrics text after the traffic
    finishes: dict[str, int] = field(default_factory=dict)  # finish_reason -> requests

    def query(self, expr: str) -> dict[str, Any]:
        import httpx

        r = httpx.get(self.prom_url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body.get("status") == "success", (expr, body)
        return body["data"]

    def vector(self, expr: str) -> list[tuple[dict[str, str], float]]:
        data = self.query(expr)
        assert data["resultType"] == "vector", (expr, data)
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]


def _wait(predicate: Any, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except Exception:  # noqa: BLE001  (not up yet: connection refused, 503, ...)
            pass
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.2)


def _traffic(url: str, model: str, stop: threading.Event, worker: int,
             finishes: dict[str, int], errors: list[str], lock: threading.Lock) -> None:
    """One client: cycles through length / stop finishes, plain and streamed, all prompts
    sharing a prefix of several KV blocks (prefix cache hits)."""
    import httpx

    from entrypoints.utils import VOCAB

    headers = {"Authorization": f"Bearer {API_KEY}"}
    i = 0
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        while not stop.is_set():
            kind = (i + worker) % 4
            body: dict[str, Any] = {"model": model, "prompt": f"{SHARED_PREFIX}{worker}.{i}",
                                    "temperature": 0, "max_tokens": 24}
            if kind in (0, 1):
                body["ignore_eos"] = True  # runs to max_tokens: "length"
                want = "length"
            else:
                body["stop_token_ids"] = list(range(VOCAB))  # the first token stops it
                want = "stop"
            i += 1
            try:
                if kind % 2:
                    body["stream"] = True
                    got = None
                    with client.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200, r.read()
                        for line in r.iter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                chunk = json.loads(line[6:])
                                assert "choices" in chunk, chunk
                                for c in chunk["choices"]:
                                    got = c.get("finish_reason") or got
                else:
                    r = client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    got = r.json()["choices"][0]["finish_reason"]
            except Exception as e:  # noqa: BLE001  (reported by the fixture)
                with lock:
                    errors.append(f"{url} {body.get('prompt')!r} {kind=}: {e!r}")
                continue
            with lock:
                if got != want:
                    errors.append(f"{url} {body.get('prompt')!r} {kind=}: finish_reason "
                                  f"{got!r}, expected {want!r}")
                finishes[want] = finishes.get(want, 0) + 1


@pytest.fixture(scope="module")
def live(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("the prometheus binary is not on PATH (Debian: apt-get install "
                    "prometheus): the dashboard's PromQL is only checked against a real one")
    for mod in ("fastapi", "uvicorn", "prometheus_client", "httpx", "transformers",
                "tokenizers"):
        pytest.importorskip(mod)
    import httpx

    # tests/ is on sys.path (pytest puts the first folder without __init__.py there).
    from entrypoints.utils import MODEL_NAME, ServerThread, free_port, make_llm

    from vllm_lite.entrypoints.openai.api_server import ServerConfig

    # The session's tiny checkpoint (tests/conftest.py), built only once the skips passed.
    model_dir: Path = request.getfixturevalue("model_dir")
    tmp = tmp_path_factory.mktemp("prometheus")

    servers: list[Any] = []
    proc: subprocess.Popen[bytes] | None = None
    log = tmp / "prometheus.log"
    try:
        llms = [make_llm(model_dir, num_gpu_blocks_override=KV_BLOCKS,
                         enable_prefix_caching=True) for _ in range(2)]
        for llm in llms:
            srv = ServerThread(llm, ServerConfig(served_model_name=MODEL_NAME, api_key=API_KEY))
            servers.append(srv.__enter__())
        instances = [f"127.0.0.1:{s.port}" for s in servers]
        # Without the key /metrics is refused: the scrape below only works through the
        # shipped authorization block.
        assert httpx.get(servers[0].url + "/metrics", timeout=10).status_code == 401

        # The shipped config with its targets, interval and key file swapped in.
        prom_config = yaml.safe_load(PROMETHEUS_YML.read_text())
        prom_config["global"].update(scrape_interval=f"{SCRAPE_S}s",
                                     scrape_timeout=f"{SCRAPE_S}s",
                                     evaluation_interval=f"{SCRAPE_S}s")
        job = prom_config["scrape_configs"][0]
        key_file = tmp / "api_key"
        key_file.write_text(API_KEY)
        job.update(_auth_block(key_file))
        job.pop("file_sd_configs", None)
        job["static_configs"] = [{**job["static_configs"][0], "targets": instances}]
        config_path = tmp / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(prom_config))

        port = free_port()
        prom_url = f"http://127.0.0.1:{port}"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [prometheus, f"--config.file={config_path}",
                 f"--storage.tsdb.path={tmp / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
        live = Live(prom_url, instances, {})

        def targets_up() -> bool:
            assert proc is not None and proc.poll() is None, "prometheus exited"
            up = {m["instance"]: v for m, v in live.vector("up")}
            return all(up.get(i) == 1.0 for i in instances)

        # Traffic starts at once: Prometheus takes ~5 s to hand new targets to its scrapers
        # (service discovery updates are batched), and TRAFFIC_S more run once it scrapes.
        errors: list[str] = []
        lock = threading.Lock()
        stop = threading.Event()
        clients = [threading.Thread(target=_traffic, args=(s.url, MODEL_NAME, stop, w,
                                                           live.finishes, errors, lock))
                   for s in servers for w in range(CLIENTS_PER_SERVER)]
        for c in clients:
            c.start()
        try:
            _wait(lambda: httpx.get(prom_url + "/-/ready", timeout=2).status_code == 200, 30,
                  "prometheus to be ready", log)
            _wait(targets_up, 15, "both targets up (authorized scrapes)", log)
            time.sleep(TRAFFIC_S)
        finally:
            stop.set()
            for c in clients:
                c.join(60)
        assert not any(c.is_alive() for c in clients), "traffic did not finish"
        assert not errors, "\n".join(errors[:10])

        headers = {"Authorization": f"Bearer {API_KEY}"}
        for s, inst in zip(servers, instances):
            live.metrics[inst] = httpx.get(s.url + "/metrics", headers=headers,
                                           timeout=10).text

        # Wait (no fixed sleep) until Prometheus holds each replica's final request count.
        from entrypoints.utils import read_metrics

        final = {inst: sum(v for k, v in read_metrics(text).items()
                           if k.startswith("vllm_lite:request_success_total"))
                 for inst, text in live.metrics.items()}

        def scraped_all() -> bool:
            got = {m["instance"]: v for m, v in
                   live.vector("sum by (instance) (vllm_lite:request_success_total)")}
            return got == final

        _wait(scraped_all, 15, f"Prometheus to scrape the final counts {final}", log)
        yield live
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for s in servers:
            s.stop()


def _values(live: Live) -> dict[str, str]:
    """Grafana's variables as Grafana fills them with "All" selected over this data."""
    return {
        "instance": "(" + "|".join(_grafana_regex_escape(i) for i in live.instances) + ")",
        "model_name": ".*",  # the model_name variable's allValue
        "datasource": "prometheus",
        "__rate_interval": RATE_WINDOW,
        "__interval": f"{SCRAPE_S}s",
        "__interval_ms": str(SCRAPE_S * 1000),
        "__range": "5m",
        "__range_s": "300",
        "__range_ms": "300000",
    }


def test_every_dashboard_metric_is_exported(live: Live) -> None:
    from entrypoints.utils import read_metrics

    dash = _dashboard()
    used = set()
    for _, t in _targets(dash):
        used |= _metric_names(t["expr"])
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            used |= {m for m in re.findall(r"label_values\(([a-zA-Z_:][\w:]*)", v["definition"])}
    for inst, text in live.metrics.items():
        exported = {re.sub(r"\{.*", "", k) for k in read_metrics(text)}
        missing = used - exported - PROMETHEUS_MADE
        assert not missing, f"{inst} does not export {sorted(missing)}"


def test_variables_list_both_replicas(live: Live) -> None:
    import httpx

    values = _values(live)
    for v in _dashboard()["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["definition"])
        assert m, v["definition"]
        selector = _substitute(m.group(1), values)
        # What Grafana calls for label_values(metric, label).
        r = httpx.get(f"{live.prom_url}/api/v1/label/{m.group(2)}/values",
                      params={"match[]": selector}, timeout=10).json()
        assert r["status"] == "success", r
        if v["name"] == "instance":
            assert sorted(r["data"]) == sorted(live.instances), r
        else:
            assert r["data"] == ["tiny-llama"], r


def test_every_panel_expression_has_data(live: Live) -> None:
    values = _values(live)
    failures = []
    checked = 0
    for title, t in _targets(_dashboard()):
        expr = _substitute(t["expr"], values)
        where = f"{title!r} {t['refId']}: {expr}"
        if "$" in expr:
            failures.append(f"{where}: a Grafana variable the test does not know")
            continue
        try:
            result = live.vector(expr)
        except AssertionError as e:
            failures.append(f"{where}: {e}")
            continue
        checked += 1
        if not result:
            failures.append(f"{where}: empty result")
            continue
        bad = [(m, v) for m, v in result if not math.isfinite(v)]
        if bad:
            failures.append(f"{where}: not finite {bad}")
        seen = {m.get("instance") for m, _ in result}
        if "{{instance}}" in t.get("legendFormat", ""):
            # Per replica: one series (per other label) for each of the two servers.
            if seen != set(live.instances):
                failures.append(f"{where}: instances {seen}, expected {live.instances}")
        elif seen != {None}:
            failures.append(f"{where}: a summed series keeps instance labels {seen}")
    assert not failures, f"{len(failures)} of the dashboard's expressions fail:\n" + \
        "\n".join(failures)
    assert checked >= 20


def test_traffic_shows_on_the_dashboard(live: Live) -> None:
    """The expressions are not only non-empty: they report what the traffic did."""
    values = _values(live)
    by = {(title, t["legendFormat"]): _substitute(t["expr"], values)
          for title, t in _targets(_dashboard())}
    assert live.finishes.get("length", 0) > 0 and live.finishes.get("stop", 0) > 0
    gen = live.vector(by["Token throughput", "{{instance}} generation"])
    assert len(gen) == 2 and all(v > 0 for _, v in gen), gen
    reasons = {m["finished_reason"]: v for m, v in live.vector(
        by["Finish reasons over the time range", "{{finished_reason}}"])}
    assert reasons.get("length", 0) > 0 and reasons.get("stop", 0) > 0, reasons
    # Every prompt shares a prefix of several blocks: hits on each replica and summed.
    hit = live.vector(by["Prefix cache hit rate", "all"])
    assert len(hit) == 1 and 0 < hit[0][1] <= 1, hit
    per_replica = live.vector(by["Prefix cache hit rate", "{{instance}}"])
    assert len(per_replica) == 2 and all(0 < v <= 1 for _, v in per_replica), per_replica
    preempted = live.vector(by["Preemptions in the time range", "preemptions"])
    assert preempted[0][1] > 0, (preempted, "the small KV cache should have preempted")
    # The gauges are back to 0 now; over the traffic they were not (the panel's own
    # expression in a subquery).
    for key in (("Scheduler: running / waiting / swapped", "{{instance}} running"),
                ("KV cache usage", "{{instance}} KV")):
        peak = live.vector(f"max_over_time(({by[key]})[{RATE_WINDOW}:{SCRAPE_S}s])")
        assert len(peak) == 2 and all(v > 0 for _, v in peak), (key, peak)
    for title in ("Time to first token (TTFT)", "Time per output token (TPOT)",
                  "End-to-end request latency"):
        for p in ("p50", "p95", "p99"):
            (q,) = live.vector(by[title, f"all {p}"])
            assert q[1] > 0, (title, p, q)
