#!/usr/bin/env python3
"""The coordinator's status page in a real browser (headless Chromium over the DevTools protocol).

Starts a coordinator with an HTTP port, an elastic job (world 4, min_world_size 2, levels (2, 2)
and (5, 4)) with four modelavg-trace-worker processes, and a second job whose only member's
worker id is HTML. Then, in Chromium:
  * /jobs/<id> shows the job id, every member (by its worker id, host:pid) and the current
    generation;
  * after kill -9 of one member it shows the death (deaths 1, the rank VACANT, a "generation
    changed" event) and the new generation, with no reload of the page (a marker set on the
    page's window object survives);
  * a worker id with HTML in it is shown as text: no element is made from it, no script runs;
  * a screenshot (PNG) is written to --artifacts_dir.

Without Chromium or python3-websocket it skips (exit 77) saying why; MODELAVG_REQUIRE_BROWSER=1
turns that into a failure (CI).
"""

import argparse
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import modelavg_testing as mt  # noqa: E402

SKIP = 77


def skip(why):
    if os.environ.get("MODELAVG_REQUIRE_BROWSER") == "1":
        mt.fail(f"MODELAVG_REQUIRE_BROWSER=1 but {why}")
    print(f"SKIP: {why}")
    sys.exit(SKIP)


class DevTools:
    """One page target of Chromium, driven over its DevTools websocket."""

    def __init__(self, ws_url):
        import websocket
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id = 0

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def eval(self, expression):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression, what, timeout_s=30):
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.2)
        mt.fail(f"the page did not show {what} within {timeout_s} s (last: {value!r}); page text:"
                f"\n{self.eval('document.body ? document.body.innerText : null')}")

    def close(self):
        self.ws.close()


def start_chromium(group, chromium, url, profile):
    argv = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--disable-dev-shm-usage", "--remote-allow-origins=*",
            f"--user-data-dir={profile}", "--remote-debugging-port=0",
            "--window-size=1280,1100", url]
    log_path = os.path.join(os.path.dirname(profile), "chromium.log")
    log = open(log_path, "w")
    # Chromium keeps org.chromium.Chromium.* folders in TMPDIR: the test's own, removed after.
    # Its singleton socket is one of them, and a Unix socket's path has at most 107 bytes: under
    # a long TMPDIR it gets a short folder of its own in /tmp (also removed after).
    tmp = os.path.dirname(profile)
    if len(tmp) > 50:
        tmp = group.temp_dir("modelavg-browser-tmp-", parent="/tmp")
    env = dict(os.environ, TMPDIR=tmp)
    proc = group.start(argv, "chromium", stdout=subprocess.DEVNULL, stderr=log, env=env)
    # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/..." on stderr.
    deadline = time.monotonic() + 60
    text = ""
    while time.monotonic() < deadline:
        text = open(log_path).read()
        m = re.search(r"DevTools listening on ws://([^/\s]+)/", text)
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            mt.fail(f"chromium exited with {proc.returncode}:\n{text[-3000:]}")
        time.sleep(0.1)
    mt.fail(f"chromium printed no DevTools address within 60 s:\n{text[-3000:]}")


def page_target(devtools_host, url_prefix, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://{devtools_host}/json/list", timeout=10) as r:
            targets = json.load(r)
        for t in targets:
            if t.get("type") == "page" and t.get("url", "").startswith(url_prefix):
                return t["webSocketDebuggerUrl"]
        time.sleep(0.2)
    mt.fail(f"no Chromium page for {url_prefix} within {timeout_s} s")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--trace_worker", required=True)
    parser.add_argument("--artifacts_dir", required=True)
    args = parser.parse_args()

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        skip("no chromium on PATH (apt-get install chromium, or bash deploy/install_deps.sh)")
    try:
        import websocket  # noqa: F401
    except ImportError:
        skip(f"{sys.executable} has no websocket module (apt-get install python3-websocket)")

    import grpc
    pb, pb_grpc = mt.coordinator_stubs()
    with mt.ProcessGroup() as group:
        work = group.temp_dir("modelavg-browser-")
        http_file = os.path.join(work, "http.port")
        coord = mt.Coordinator(group, args.coordinator, workdir=work, extra_flags=[
            "--metrics_listen=127.0.0.1:0", f"--metrics_port_file={http_file}"])
        http = open(http_file).read().strip()
        channel = grpc.insecure_channel(coord.address)
        stub = pb_grpc.CoordinatorStub(channel)

        job_id = "status-demo"
        stub.CreateJob(pb.CreateJobRequest(spec=pb.JobSpec(
            job_id=job_id, world_size=4, mode=pb.HIERARCHICAL, min_world_size=2,
            heartbeat_timeout_ms=1500,
            levels=[pb.Level(period=2, group_size=2), pb.Level(period=5, group_size=4)])),
            timeout=10)
        workers = []
        for rank in range(4):
            workers.append(group.start(
                [args.trace_worker, f"--coordinator={coord.address}", f"--job={job_id}",
                 f"--rank={rank}", "--world_size=4", "--steps=1000000", "--numel=16",
                 "--step_delay_ms=40", "--collective_timeout_ms=20000"],
                f"worker{rank}", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        # The second job: its member's worker id is markup.
        evil = '<b id="injected">bold</b><img src=x onerror="window.injected=1">'
        stub.CreateJob(pb.CreateJobRequest(spec=pb.JobSpec(
            job_id="escape-check", world_size=1, mode=pb.PERIODIC, heartbeat_timeout_ms=60000,
            levels=[pb.Level(period=1, group_size=1)])), timeout=10)
        stub.Join(pb.JoinRequest(job_id="escape-check", worker_id=evil, host="h<i>x</i>"),
                  timeout=10)

        deadline = time.monotonic() + 60
        while True:
            job = stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10)
            if job.state == pb.RUNNING and job.max_step >= 3:
                break
            if time.monotonic() > deadline:
                mt.fail(f"the job did not start running within 60 s:\n{coord.log_tail()}")
            time.sleep(0.1)

        url = f"http://{http}/jobs/{job_id}"
        chrome, devtools_host = start_chromium(group, chromium, url,
                                               os.path.join(work, "profile"))
        page = DevTools(page_target(devtools_host, f"http://{http}/"))
        page.call("Runtime.enable")
        page.wait_for("document.readyState === 'complete' && "
                      "!!document.getElementById('members')", "the members table")

        text = page.eval("document.body.innerText")
        if page.eval("document.getElementById('job-id').textContent") != job_id:
            mt.fail(f"the page does not show the job id {job_id}:\n{text}")
        job = stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10)
        rows = page.eval("Array.from(document.querySelectorAll('#members tr.member'))"
                         ".map(r => r.innerText)")
        if len(rows) != 4:
            mt.fail(f"expected 4 member rows, got {len(rows)}: {rows}")
        for m in job.members:
            if not any(m.worker_id in r for r in rows):
                mt.fail(f"member {m.rank} ({m.worker_id}) is not on the page: {rows}")
        shown_generation = int(page.eval("document.getElementById('generation').textContent"))
        if shown_generation != job.generation:
            mt.fail(f"the page shows generation {shown_generation}, GetJob {job.generation}")
        print(f"page shows job {job_id}, 4 members, generation {shown_generation}")

        # No reload from here on: the marker must survive the page's own refreshes.
        page.eval("window.__modelavgMarker = 'kept'; true")
        victim = workers[2]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        print(f"killed rank 2 (pid {victim.pid}) with SIGKILL")
        page.wait_for(
            f"Number(document.getElementById('generation').textContent) > {shown_generation} && "
            "document.getElementById('deaths').textContent === '1' && "
            "!!document.querySelector('#members tr.dead, #members tr.vacant') && "
            "document.getElementById('events').innerText.includes('generation changed')",
            "the death and a new generation", timeout_s=30)
        if page.eval("window.__modelavgMarker") != "kept":
            mt.fail("the page was reloaded (the marker on its window object is gone)")
        job = stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10)
        shown = page.eval("document.getElementById('generation').textContent")
        print(f"page shows the death and generation {shown} (GetJob: {job.generation}) "
              "without a reload")
        time.sleep(1.5)  # a few more steps on the page and its timeline

        os.makedirs(args.artifacts_dir, exist_ok=True)
        page.call("Emulation.setDeviceMetricsOverride", width=1280, height=1100,
                  deviceScaleFactor=1, mobile=False)
        shot = page.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        png = os.path.join(args.artifacts_dir, "status-page.png")
        with open(png, "wb") as f:
            f.write(base64.b64decode(shot["data"]))
        print(f"screenshot: {png}")

        # Markup in a worker id (and a host) is text.
        page.call("Page.navigate", url=f"http://{http}/jobs/escape-check")
        page.wait_for("document.readyState === 'complete' && "
                      "document.getElementById('job-id') && "
                      "document.getElementById('job-id').textContent === 'escape-check'",
                      "the escape-check job")
        time.sleep(1.5)  # one refresh too
        if page.eval("!!document.getElementById('injected') || !!document.querySelector("
                     "'#members img, #members b, #members i')"):
            mt.fail("the worker id's markup became elements on the page")
        if page.eval("window.injected === 1"):
            mt.fail("the worker id's onerror handler ran")
        members_text = page.eval("document.getElementById('members').innerText")
        if evil not in members_text:
            mt.fail(f"the worker id is not shown as text: {members_text}")
        print("a worker id with HTML in it is shown as text")

        # The index lists both jobs.
        page.call("Page.navigate", url=f"http://{http}/")
        page.wait_for("document.getElementById('jobs') && "
                      "document.getElementById('jobs').innerText.includes('escape-check') && "
                      f"document.getElementById('jobs').innerText.includes('{job_id}')",
                      "both jobs on the index")
        page.close()
        chrome.send_signal(signal.SIGTERM)
        try:
            chrome.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        channel.close()
    print("status page browser test: 1 passed, 0 failed")


if __name__ == "__main__":
    main()
