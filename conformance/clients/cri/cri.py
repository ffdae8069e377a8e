#!/usr/bin/python3
"""A minimal CRI v1 client for conformance/tests/containerd.rs (crictl cannot be built here).

    cri.py --socket PATH --gen DIR CALL      request as JSON on stdin, response as JSON on stdout

CALL is a method of runtime.v1.RuntimeService (Version, RunPodSandbox, StopPodSandbox,
RemovePodSandbox, PodSandboxStatus) or ImageService (ImageStatus). DIR holds runtime_v1_pb2.py,
generated from runtime_v1.proto by conformance/clients/deps.sh. JSON uses the proto field names
(pod_sandbox_id), with default values included (state SANDBOX_READY). A failed call exits 1 with the gRPC status code and message on stderr: the
message is what the runtime says, e.g. the CNI plugin's error for a sandbox that failed.

Debian's python3-grpcio and python3-protobuf, run with /usr/bin/python3.
"""
import argparse
import sys

import grpc
from google.protobuf import json_format

SERVICES = {
    "Version": "RuntimeService",
    "RunPodSandbox": "RuntimeService",
    "StopPodSandbox": "RuntimeService",
    "RemovePodSandbox": "RuntimeService",
    "PodSandboxStatus": "RuntimeService",
    "ImageStatus": "ImageService",
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--gen", required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("call", choices=sorted(SERVICES))
    a = p.parse_args()
    sys.path.insert(0, a.gen)
    import runtime_v1_pb2 as api

    request = json_format.Parse(sys.stdin.read() or "{}", getattr(api, a.call + "Request")())
    with grpc.insecure_channel("unix://" + a.socket) as channel:
        method = channel.unary_unary(
            "/runtime.v1.%s/%s" % (SERVICES[a.call], a.call),
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=getattr(api, a.call + "Response").FromString,
        )
        try:
            response = method(request, timeout=a.timeout)
        except grpc.RpcError as e:
            sys.stderr.write("%s %s: %s\n" % (a.call, e.code().name, e.details()))
            return 1
    print(json_format.MessageToJson(response, preserving_proto_field_name=True, including_default_value_fields=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
