"""A small grpcurl stand-in: list, describe and call a gRPC server through
server reflection alone, with no .proto file of the service.

Usage (Debian's /usr/bin/python3 with python3-grpcio; protoc, grpc_python_plugin
and grpc-proto installed):
  grpc_reflect.py ADDR list
  grpc_reflect.py ADDR describe SYMBOL          # a service, method or message
  grpc_reflect.py ADDR call SERVICE/METHOD JSON # unary or server-streaming

The reflection stubs are generated at run time from Debian's grpc-proto, into a
temporary folder not named "grpc" (a generated grpc/ tree would shadow the
installed grpc package).
"""
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory


def message_class(pool, descriptor):
    """The message class of `descriptor`: GetMessageClass from protobuf 4.21 on
    (Debian's python3-protobuf has both; 5.x and later only this)."""
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)


GRPC_PROTO = os.environ.get("GRPC_PROTO_DIR", "/usr/share/grpc-proto")


def reflection_module():
    out = tempfile.mkdtemp(prefix="wsreflect-")
    pkg = os.path.join(out, "wsreflect")
    os.makedirs(pkg)
    shutil.copy(os.path.join(GRPC_PROTO, "grpc/reflection/v1alpha/reflection.proto"), pkg)
    subprocess.check_call(["protoc", f"-I{out}", f"--python_out={out}", f"--grpc_out={out}",
                           "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin", "wsreflect/reflection.proto"])
    open(os.path.join(pkg, "__init__.py"), "w").close()
    sys.path.insert(0, out)
    return importlib.import_module("wsreflect.reflection_pb2"), importlib.import_module("wsreflect.reflection_pb2_grpc")


class Reflector:
    def __init__(self, channel):
        self.pb2, pb2_grpc = reflection_module()
        self.stub = pb2_grpc.ServerReflectionStub(channel)
        self.pool = descriptor_pool.DescriptorPool()
        self.loaded = set()

    def _ask(self, **kwargs):
        responses = list(self.stub.ServerReflectionInfo(iter([self.pb2.ServerReflectionRequest(**kwargs)])))
        r = responses[0]
        if r.HasField("error_response"):
            raise LookupError(r.error_response.error_message)
        return r

    def services(self):
        return sorted(s.name for s in self._ask(list_services="").list_services_response.service)

    def _add(self, serialized_files):
        files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in serialized_files]
        by_name = {f.name: f for f in files}
        def add(f):
            if f.name in self.loaded:
                return
            for dep in f.dependency:
                if dep in by_name:
                    add(by_name[dep])
                elif dep not in self.loaded:
                    self._add(self._ask(file_by_filename=dep).file_descriptor_response.file_descriptor_proto)
            self.pool.Add(f)
            self.loaded.add(f.name)
        for f in files:
            add(f)

    def load_symbol(self, symbol):
        self._add(self._ask(file_containing_symbol=symbol).file_descriptor_response.file_descriptor_proto)

    def describe(self, symbol):
        self.load_symbol(symbol.rsplit("/", 1)[0] if "/" in symbol else symbol)
        for finder in (self.pool.FindServiceByName, self.pool.FindMessageTypeByName, self.pool.FindMethodByName):
            try:
                d = finder(symbol.replace("/", "."))
            except KeyError:
                continue
            proto = type(d).__name__
            if hasattr(d, "methods"):
                return {"service": d.full_name, "methods": [
                    {"name": m.name, "input": m.input_type.full_name, "output": m.output_type.full_name,
                     "server_streaming": getattr(m, "server_streaming", None)} for m in d.methods]}
            if hasattr(d, "fields"):
                return {"message": d.full_name, "fields": [{"name": f.name, "number": f.number} for f in d.fields]}
            return {proto: d.full_name}
        raise LookupError(f"symbol not found: {symbol}")

    def call(self, channel, method, body, server_streaming=None):
        service, name = method.split("/")
        self.load_symbol(service)
        m = self.pool.FindServiceByName(service).FindMethodByName(name)
        request_class = message_class(self.pool, m.input_type)
        response_class = message_class(self.pool, m.output_type)
        request = json_format.Parse(body, request_class())
        path = f"/{service}/{name}"
        kwargs = dict(request_serializer=lambda x: x.SerializeToString(), response_deserializer=response_class.FromString)
        streaming = m.server_streaming if hasattr(m, "server_streaming") else server_streaming
        if streaming:
            return [json_format.MessageToDict(r) for r in channel.unary_stream(path, **kwargs)(request, timeout=30)]
        return json_format.MessageToDict(channel.unary_unary(path, **kwargs)(request, timeout=30))


def main():
    addr, verb = sys.argv[1], sys.argv[2]
    channel = grpc.insecure_channel(addr)
    r = Reflector(channel)
    try:
        if verb == "list":
            result = r.services()
        elif verb == "describe":
            result = r.describe(sys.argv[3])
        elif verb == "call":
            result = r.call(channel, sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "{}")
        else:
            raise SystemExit(f"unknown verb {verb}")
    except grpc.RpcError as e:
        print(json.dumps({"code": e.code().name, "details": e.details()}))
        return 3
    print(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
