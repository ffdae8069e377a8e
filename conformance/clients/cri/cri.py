#!/usr/bin/python3
"""A minimal CRI v1 client for conformance/tests/containerd.rs (crictl cannot be built here).

    cri.py --socket PATH --gen DIR CALL      request as JSON on stdin, response as JSON on stdout
    cri.py --socket PATH --gen DIR --serve   one call per line: {"call": CALL, "request": {...}}
                                             in, {"response": {...}} or {"error": "..."} out

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


def call(api, socket, name, request_json, timeout):
    """(response as a dict, None) or (None, error text)."""
    if name not in SERVICES:
        return None, "unknown call %r" % name
    request = json_format.Parse(request_json, getattr(api, name + "Request")())
    with grpc.insecure_channel("unix://" + socket) as channel:
        method = channel.unary_unary(
            "/runtime.v1.%s/%s" % (SERVICES[name], name),
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=getattr(api, name + "Response").FromString,
        )
        try:
            response = method(request, timeout=timeout)
        except grpc.RpcError as e:
            return None, "%s %s: %s" % (name, e.code().name, e.details())
    return json_format.MessageToDict(
        response, preserving_proto_field_name=True, including_default_value_fields=True
    ), None


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
        response, error = call(api, a.socket, a.call, sys.stdin.read() or "{}", a.timeout)
        if error:
            sys.stderr.write(error + "\n")
            return 1
        print(json.dumps(response, indent=2))
        return 0
    for line in sys.stdin:
        msg = json.loads(line)
        response, error = call(api, a.socket, msg["call"], json.dumps(msg.get("request", {})), a.timeout)
        print(json.dumps({"error": error} if error else {"response": response}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
