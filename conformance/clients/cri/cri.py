#!/usr/bin/python3
"""A minimal CRI v1 client for conformance/tests/containerd.rs (crictl cannot be built here).

    cri.py --socket PATH --gen DIR CALL      request as JSON on stdin, response as JSON on stdout
    cri.py --socket PATH --gen DIR --serve   one call per line: {"call": CALL, "request": {...}}
                                             in, {"response": {...}} or {"error": "..."} out,
                                             with "seconds": the call's own wall time; or
                                             {"at_once": [{"call": ..., "request": ...}, ...]}
                                             in: every call at the same moment, a thread each,
                                             {"answers": [...], "seconds": wall} out

CALL is a method of runtime.v1.RuntimeService (Version, RunPodSandbox, StopPodSandbox,
RemovePodSandbox, PodSandboxStatus, ListPodSandbox, Status) or ImageService (ImageStatus).
DIR holds runtime_v1_pb2.py, generated from cri/proto/runtime_v1.proto (the aether-cri
crate's, shared with the installer) by conformance/clients/deps.sh. JSON uses the proto field names
(pod_sandbox_id), with default values included (state SANDBOX_READY). A failed call gives the
gRPC status code and message: the message is what the runtime says, e.g. the CNI plugin's
error for a sandbox that failed. --serve pays Python's and grpc's start-up once (about a second
on a loaded machine) instead of once per call; each call connects anew, so a restarted
containerd is simply reached again.

Debian's python3-grpcio and python3-protobuf, run with /usr/bin/python3.
"""
import argparse
import json
import sys
import threading
import time

import grpc
from google.protobuf import json_format

SERVICES = {
    "Version": "RuntimeService",
    "RunPodSandbox": "RuntimeService",
    "StopPodSandbox": "RuntimeService",
    "RemovePodSandbox": "RuntimeService",
    "PodSandboxStatus": "RuntimeService",
    "ListPodSandbox": "RuntimeService",
    "Status": "RuntimeService",
    "ImageStatus": "ImageService",
}


def call(api, socket, name, request_json, timeout, channel_ready=None):
    """(response as a dict, None, seconds) or (None, error text, seconds): seconds is the
    call's wall time, from sending the request to its answer (0 for a request not sent).
    `channel_ready`: called once the channel is connected, before the request is sent."""
    if name not in SERVICES:
        if channel_ready:
            channel_ready()
        return None, "unknown call %r" % name, 0.0
    request = json_format.Parse(request_json, getattr(api, name + "Request")())
    with grpc.insecure_channel("unix://" + socket) as channel:
        method = channel.unary_unary(
            "/runtime.v1.%s/%s" % (SERVICES[name], name),
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=getattr(api, name + "Response").FromString,
        )
        if channel_ready:
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout)
            except grpc.FutureTimeoutError:
                pass  # the call then fails as it would have
            channel_ready()
        started = time.monotonic()
        try:
            response = method(request, timeout=timeout)
        except grpc.RpcError as e:
            return None, "%s %s: %s" % (name, e.code().name, e.details()), time.monotonic() - started
        seconds = time.monotonic() - started
    return json_format.MessageToDict(
        response, preserving_proto_field_name=True, including_default_value_fields=True
    ), None, seconds


def answer(response, error, seconds):
    if error:
        return {"error": error, "seconds": seconds}
    return {"response": response, "seconds": seconds}


def at_once(api, socket, calls, timeout):
    """Every call of `calls` at the same moment: a thread and a channel each, released
    together once every channel is connected. Each one's answer, and the wall time from the
    first call's start to the last answer (each thread notes its own: the releasing thread
    may run again only after many calls have started)."""
    results = [None] * len(calls)
    starts = [None] * len(calls)
    ends = [None] * len(calls)
    release = threading.Barrier(len(calls) + 1, timeout=timeout)

    def one(i, msg):
        def released():
            release.wait()
            starts[i] = time.monotonic()

        results[i] = answer(*call(api, socket, msg["call"], json.dumps(msg.get("request", {})), timeout, released))
        ends[i] = time.monotonic()

    threads = [threading.Thread(target=one, args=(i, m)) for i, m in enumerate(calls)]
    for t in threads:
        t.start()
    release.wait()
    for t in threads:
        t.join()
    began = [s for s in starts if s is not None]
    seconds = max(ends) - min(began) if began else 0.0
    return {"answers": results, "seconds": seconds}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--gen", required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--serve", action="store_true")
    p.add_argument("call", nargs="?", choices=sorted(SERVICES))
    a = p.parse_args()
    sys.path.insert(0, a.gen)
    import runtime_v1_pb2 as api

    if not a.serve:
        response, error, _ = call(api, a.socket, a.call, sys.stdin.read() or "{}", a.timeout)
        if error:
            sys.stderr.write(error + "\n")
            return 1
        print(json.dumps(response, indent=2))
        return 0
    for line in sys.stdin:
        msg = json.loads(line)
        if "at_once" in msg:
            print(json.dumps(at_once(api, a.socket, msg["at_once"], a.timeout)), flush=True)
            continue
        out = answer(*call(api, a.socket, msg["call"], json.dumps(msg.get("request", {})), a.timeout))
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
