#!/usr/bin/env bash
# Builds, on this machine (Debian with libgrpc++-dev, protobuf-compiler-grpc), the C++ gRPC load
# generator of `mmad bench --service --grpc-generator` (bench/grpc_loadgen/loadgen.cc) into
# .grpcgen/: the binary and the shared libraries it needs beyond the C library, so that a GPU host
# without them runs it (carry .grpcgen: the binary finds .grpcgen/lib through its rpath).
#   sudo apt-get install -y libgrpc++-dev protobuf-compiler-grpc   (once)
#   bash scripts/gpu/grpc_loadgen.sh [OUT]      (default .grpcgen)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.grpcgen}
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
protoc -I mmad/grpc/protos --cpp_out="$build" --grpc_out="$build" --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" \
  mmad/grpc/protos/grpc_service.proto mmad/grpc/protos/model_config.proto
mkdir -p "$out/lib"
g++ -O2 -std=c++17 -I "$build" bench/grpc_loadgen/loadgen.cc "$build"/grpc_service.pb.cc "$build"/grpc_service.grpc.pb.cc \
  "$build"/model_config.pb.cc -o "$out/loadgen" $(pkg-config --cflags --libs grpc++ protobuf) -pthread \
  -Wl,--disable-new-dtags,-rpath,'$ORIGIN/lib'  # RPATH, not RUNPATH: the libraries' own dependencies are found there too
# every library it loads but the C library's own (libc, libm, the loader), which the host has
ldd "$out/loadgen" | awk '/=> \// {print $3}' | grep -vE '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' \
  | while read -r lib; do cp -L "$lib" "$out/lib/"; done
du -sh "$out"
