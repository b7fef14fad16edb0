"""The processes of a run: the fake engine and the systems under test (SUTs).

Every process is started with ``taskset -c CPUS`` when pinning is on (see docs/BENCH-METHOD.md):
the SUT gets its own core, the engine and the load generator share the other.

Targets (all reached at an OpenAI ``/v1/chat/completions`` path by the load generator):

* ``direct``: the fake engine's own OpenAI-compatible path; ``n > 1`` becomes n parallel
  requests with ``n = 1`` (there is no SUT; CPU per chunk is not defined);
* ``sieproxy``: ``python -m sieproxy serve`` (one process) in front of the engine's native
  ``/generate``; ``hypercorn-wK``: ``hypercorn --workers K sieproxy.asgi:app``;
* ``nginx``: Debian's nginx as a pure relay (one worker, ``proxy_buffering off``, upstream
  keep-alive); ``n > 1`` becomes n parallel requests, as for direct;
* ``litellm``: LiteLLM's proxy in its own virtualenv (one worker, no database, no callbacks);
* the floors of the gateway's stack (``FLOORS``): ``trio-pipe``, ``trio-pipe-streams`` and
  ``hypercorn-relay`` (see ``bench/triopipe.py`` and ``bench/hyperrelay.py``); ``n > 1``
  becomes n parallel requests, as for nginx.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
PY = sys.executable
LITELLM_VENV = OUT / "litellm-venv"
LITELLM_KEY = "sk-bench-master-key"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def taskset(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


def http_get(port: int, path: str, timeout: float = 2.0, headers: dict[str, str] | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def wait_http(port: int, path: str, deadline: float, proc: subprocess.Popen | None = None,
              headers: dict[str, str] | None = None, what: str = "") -> None:
    end = time.monotonic() + deadline
    last = ""
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before becoming ready")
        try:
            st, _ = http_get(port, path, headers=headers)
            if st == 200:
                return
            last = f"HTTP {st}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready on :{port}{path} after {deadline}s ({last})")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    port: int
    tmp: str | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self) -> None:
        p = self.popen
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


def spawn(name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
          tmp: str | None = None, cwd: Path = ROOT) -> Proc:
    OUT.mkdir(parents=True, exist_ok=True)
    log = OUT / f"{name.replace('/', '_')}.log"  # a target may name a revision: sieproxy@a/b
    f = open(log, "wb")  # noqa: SIM115 - handed to the child
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.Popen(
        argv, stdout=f, stderr=subprocess.STDOUT, env=e, cwd=cwd, start_new_session=True
    )
    f.close()
    return Proc(name, p, log, port, tmp)


# ---- the engine -----------------------------------------------------------------------------


#: The Python engines, run with ``-m``; the kind ``native`` is bench/native/harness.c.
ENGINES = {"fast": "bench.fastengine", "fake": "bench.engine_proc"}


def start_engine(ttft_ms: float, itl_ms: float, tokens: int, cpus: str | None,
                 incremental: bool = True, kind: str = "fast") -> Proc:
    """``fast``: bench/fastengine.py (default); ``fake``: engine/fake.py (bench/engine_proc.py);
    ``native``: the C engine of bench/native/harness.c (built on first use, see bench/native.py).
    """
    port = free_port()
    if kind == "native":
        from bench import native

        argv = taskset(cpus) + native.engine_argv(port, ttft_ms, itl_ms, tokens, incremental)
    else:
        argv = taskset(cpus) + [
            PY, "-m", ENGINES[kind], "--port", str(port), "--ttft-ms", str(ttft_ms),
            "--itl-ms", str(itl_ms), "--tokens", str(tokens),
        ] + (["--incremental"] if incremental else [])
    p = spawn("engine", argv, port)
    wait_http(port, "/health", 30, p.popen, what="fake engine")
    return p


def engine_stats(port: int) -> dict[str, int]:
    _, body = http_get(port, "/_bench/stats", timeout=10)
    return json.loads(body)


# ---- systems under test ---------------------------------------------------------------------


@dataclass
class Target:
    """How the load generator reaches a started target."""

    name: str
    port: int
    path: str = "/v1/chat/completions"
    headers: dict[str, str] = field(default_factory=dict)
    split_n: bool = False  # n > 1 becomes n parallel n=1 requests
    proc: Proc | None = None

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None else []

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def sieproxy_config(engine_port: int, port: int, tmpdir: str) -> str:
    path = os.path.join(tmpdir, "sieproxy-bench.toml")
    with open(path, "w") as f:
        f.write(
            "[gateway]\n"
            f"port = {port}\n"
            "access_log = false\n"
            'log_level = "warning"\n'
            "replica_max_inflight = 65536\n"
            "max_keepalive_connections = 4096\n"
            "\n[models.bench-model]\n"
            f'engines = ["http://127.0.0.1:{engine_port}"]\n'
            f"chat_template = {json.dumps(CHAT_TEMPLATE)}\n"
        )
    return path


def source_tree(rev: str) -> Path:
    """The project's files at git revision ``rev``, unpacked once into bench/out/trees/ (for a
    ``sieproxy@REV`` target: that build of the gateway beside this one, in the same run)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, check=True,
        capture_output=True, text=True,
    ).stdout.strip()
    tree = OUT / "trees" / sha[:12]
    if not tree.is_dir():
        tree.parent.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        # Unpacked beside it and renamed: an interrupted unpack never passes for a whole tree.
        part = Path(tempfile.mkdtemp(prefix=f"{sha[:12]}-", dir=tree.parent))
        subprocess.run(["tar", "-x", "-C", str(part)], input=archive, check=True)
        part.rename(tree)
    return tree


def start_sieproxy(engine_port: int, cpus: str | None, workers: int = 1,
                   hypercorn: bool = False, rev: str | None = None) -> Target:
    """The gateway; ``rev``: the build of that git revision (run from its own tree, with the
    same interpreter and dependencies), named ``sieproxy@REV``."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="bench-sieproxy-")
    cfg = sieproxy_config(engine_port, port, tmp)
    env, cwd = {"SIEPROXY_CONFIG": cfg}, ROOT
    if rev is not None:  # that revision's files come first on the path, and are the cwd
        cwd = source_tree(rev)
        env["PYTHONPATH"] = str(cwd)
    if workers == 1 and not hypercorn:
        argv = [*taskset(cpus), PY, "-m", "sieproxy", "serve", "--config", cfg]
        name = "sieproxy" if rev is None else f"sieproxy@{rev}"
    else:
        hyper = str(Path(PY).parent / "hypercorn")
        argv = [
            *taskset(cpus), hyper, "--worker-class", "trio", "--workers", str(workers), "--bind",
            f"127.0.0.1:{port}", "--keep-alive", "75", "--backlog", "2048", "sieproxy.asgi:app",
        ]
        name = f"hypercorn-w{workers}"
    p = spawn(name, argv, port, env=env, tmp=tmp, cwd=cwd)
    wait_http(port, "/readyz", 60, p.popen, what=name)
    return Target(name, port, proc=p)


def nginx_binary() -> str | None:
    for cand in ("/usr/sbin/nginx", shutil.which("nginx")):
        if cand and os.path.exists(cand):
            return cand
    return None


def ensure_nginx(log=print) -> str | None:
    """Debian's nginx, installed with apt-get if missing; None if that fails."""
    b = nginx_binary()
    if b:
        return b
    log("nginx not found: running `apt-get update && apt-get install -y nginx-light` ...")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-qq", "nginx-light"], check=True, env=env,
                       stdout=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError) as exc:
        log(f"nginx install failed: {exc}")
        return None
    return nginx_binary()


NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
user root;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 16384; multi_accept on; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    upstream engine {{
        server 127.0.0.1:{engine_port};
        keepalive 4096;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 3600s;
        }}
    }}
}}
"""


def start_nginx(engine_port: int, cpus: str | None) -> Target:
    b = ensure_nginx()
    if b is None:
        raise RuntimeError("nginx is not installed and could not be installed")
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="bench-nginx-")
    conf = os.path.join(tmp, "nginx.conf")
    with open(conf, "w") as f:
        f.write(NGINX_CONF.format(tmp=tmp, engine_port=engine_port, port=port))
    p = spawn("nginx", [*taskset(cpus), b, "-c", conf, "-p", tmp], port, tmp=tmp)
    wait_http(port, "/health", 20, p.popen, what="nginx")
    return Target("nginx", port, split_n=True, proc=p)


#: Relays that show the floor of the gateway's stack (each a module of this package, started
#: with the port to serve and the engine's port): a trio TCP pipe on descriptors, the same on
#: trio's SocketStream, and Hypercorn on trio relaying the engine's bytes through the gateway's
#: upstream client with no gateway logic.
FLOORS = {
    "trio-pipe": ["-m", "bench.triopipe"],
    "trio-pipe-streams": ["-m", "bench.triopipe", "--streams"],
    "hypercorn-relay": ["-m", "bench.hyperrelay"],
    "trio-pump": ["-m", "bench.triopipe", "--pump"],
}


def start_floor(name: str, engine_port: int, cpus: str | None) -> Target:
    port = free_port()
    tmp = tempfile.mkdtemp(prefix=f"bench-{name}-")
    p = spawn(name, [*taskset(cpus), PY, *FLOORS[name], str(port), str(engine_port)], port, tmp=tmp)
    wait_http(port, "/health", 30, p.popen, what=name)
    return Target(name, port, split_n=True, proc=p)


def litellm_bin() -> Path:
    return LITELLM_VENV / "bin" / "litellm"


#: The LiteLLM the bench installs: the release every recorded LiteLLM figure was measured with
#: (bench/RESULTS.md); a newer one is a different peer, to be recorded as such.
LITELLM_REQUIREMENT = "litellm[proxy]==1.108.7"


def ensure_litellm(log=print) -> str | None:
    """LiteLLM's proxy in bench/out/litellm-venv; returns its version, or None."""
    py = LITELLM_VENV / "bin" / "python"
    if not litellm_bin().exists():
        log(f"installing {LITELLM_REQUIREMENT} into {LITELLM_VENV} (a few minutes) ...")
        try:
            subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
            subprocess.run([str(py), "-m", "pip", "install", "-q", LITELLM_REQUIREMENT], check=True,
                           stdout=subprocess.DEVNULL)
        except (OSError, subprocess.CalledProcessError) as exc:
            log(f"litellm install failed: {exc}")
            return None
    return litellm_version()


def litellm_version() -> str | None:
    py = LITELLM_VENV / "bin" / "python"
    if not py.exists():
        return None
    try:
        out = subprocess.run(
            [str(py), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True, text=True, check=True, timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


LITELLM_CONF = """\
model_list:
  - model_name: bench-model
    litellm_params:
      model: openai/bench-model
      api_base: http://127.0.0.1:{engine_port}/v1
      api_key: unused
general_settings:
  master_key: {key}
litellm_settings:
  telemetry: false
  drop_params: true
"""


def start_litellm(engine_port: int, cpus: str | None) -> Target:
    if ensure_litellm() is None:
        raise RuntimeError("LiteLLM could not be installed")
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="bench-litellm-")
    conf = os.path.join(tmp, "litellm.yaml")
    with open(conf, "w") as f:
        f.write(LITELLM_CONF.format(engine_port=engine_port, key=LITELLM_KEY))
    env = {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
        "DISABLE_SCHEMA_UPDATE": "True",
        "NO_DOCS": "True",
    }
    env.pop("DATABASE_URL", None)
    argv = [
        *taskset(cpus), str(litellm_bin()), "--config", conf, "--host", "127.0.0.1",
        "--port", str(port), "--num_workers", "1",
    ]
    p = spawn("litellm", argv, port, env=env, tmp=tmp)
    auth = {"Authorization": f"Bearer {LITELLM_KEY}"}
    wait_http(port, "/health/liveliness", 180, p.popen, what="litellm")
    return Target("litellm", port, headers=auth, proc=p)


def start_target(name: str, engine_port: int, cpus: str | None) -> Target:
    if name == "direct":
        return Target("direct", engine_port, split_n=True)
    if name == "sieproxy":
        return start_sieproxy(engine_port, cpus)
    if name.startswith("sieproxy@"):  # another build of the gateway, for an A/B in one run
        return start_sieproxy(engine_port, cpus, rev=name[len("sieproxy@"):])
    if name.startswith("hypercorn-w"):
        return start_sieproxy(engine_port, cpus, workers=int(name[11:]), hypercorn=True)
    if name == "nginx":
        return start_nginx(engine_port, cpus)
    if name == "litellm":
        return start_litellm(engine_port, cpus)
    if name in FLOORS:
        return start_floor(name, engine_port, cpus)
    raise ValueError(f"unknown target {name!r}")
