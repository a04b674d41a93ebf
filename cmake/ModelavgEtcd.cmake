# Decides whether the coordinator's etcd state store (--etcd_endpoints) is built. Sets
# MODELAVG_HAVE_ETCD (ON/OFF) and, when ON, the library target modelavg_etcd_proto: C++ stubs of
# etcd's v3 gRPC API generated at build time from the .proto files Debian ships
#   golang-etcd-server-dev                         etcd/etcdserver/etcdserverpb/rpc.proto, ...
#   golang-github-gogo-protobuf-dev                gogoproto/gogo.proto
#   golang-github-grpc-ecosystem-grpc-gateway-dev  google/api/annotations.proto, http.proto
# AUTO builds it when all three are found; ON fails the configure if one is missing; OFF never
# looks. Without it the coordinator still builds and --etcd_endpoints says what to install.
set(MODELAVG_WITH_ETCD AUTO CACHE STRING "Build the coordinator's etcd state store: AUTO, ON or OFF")
set_property(CACHE MODELAVG_WITH_ETCD PROPERTY STRINGS AUTO ON OFF)
set(MODELAVG_HAVE_ETCD OFF)
if(NOT MODELAVG_WITH_ETCD MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "MODELAVG_WITH_ETCD must be AUTO, ON or OFF, got '${MODELAVG_WITH_ETCD}'")
endif()
if(NOT MODELAVG_WITH_ETCD STREQUAL "OFF")
  set(_gocode /usr/share/gocode/src)
  find_path(MODELAVG_ETCD_PROTO_ROOT etcd/etcdserver/etcdserverpb/rpc.proto
            HINTS ${_gocode}/go.etcd.io NO_DEFAULT_PATH)
  find_path(MODELAVG_GOGO_PROTO_ROOT gogoproto/gogo.proto
            HINTS ${_gocode}/github.com/gogo/protobuf NO_DEFAULT_PATH)
  find_path(MODELAVG_GOOGLEAPIS_PROTO_ROOT google/api/annotations.proto
            HINTS ${_gocode}/github.com/grpc-ecosystem/grpc-gateway/third_party/googleapis
                  /usr/share/googleapis /usr/include NO_DEFAULT_PATH)
  if(MODELAVG_ETCD_PROTO_ROOT AND MODELAVG_GOGO_PROTO_ROOT AND MODELAVG_GOOGLEAPIS_PROTO_ROOT)
    set(_out ${CMAKE_BINARY_DIR}/etcd_gen)
    file(MAKE_DIRECTORY ${_out})
    # proto file (relative to its root) -> generated sources; rpc.proto is the only one with
    # services.
    set(_protos
      "${MODELAVG_GOGO_PROTO_ROOT}|gogoproto/gogo"
      "${MODELAVG_GOOGLEAPIS_PROTO_ROOT}|google/api/http"
      "${MODELAVG_GOOGLEAPIS_PROTO_ROOT}|google/api/annotations"
      "${MODELAVG_ETCD_PROTO_ROOT}|etcd/mvcc/mvccpb/kv"
      "${MODELAVG_ETCD_PROTO_ROOT}|etcd/auth/authpb/auth"
      "${MODELAVG_ETCD_PROTO_ROOT}|etcd/etcdserver/etcdserverpb/rpc")
    set(_srcs)
    set(_inputs)
    set(_files)
    foreach(_entry ${_protos})
      string(REPLACE "|" ";" _pair "${_entry}")
      list(GET _pair 0 _root)
      list(GET _pair 1 _name)
      list(APPEND _files ${_name}.proto)
      list(APPEND _inputs ${_root}/${_name}.proto)
      list(APPEND _srcs ${_out}/${_name}.pb.cc ${_out}/${_name}.pb.h)
    endforeach()
    list(APPEND _srcs ${_out}/etcd/etcdserver/etcdserverpb/rpc.grpc.pb.cc
                      ${_out}/etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h)
    find_program(MODELAVG_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)
    # google/protobuf/descriptor.proto (imported by gogo.proto).
    set(_wkt)
    foreach(_dir ${Protobuf_INCLUDE_DIRS})
      list(APPEND _wkt --proto_path=${_dir})
    endforeach()
    add_custom_command(
      OUTPUT ${_srcs}
      COMMAND protobuf::protoc
      ARGS --proto_path=${MODELAVG_ETCD_PROTO_ROOT} --proto_path=${MODELAVG_GOGO_PROTO_ROOT}
           --proto_path=${MODELAVG_GOOGLEAPIS_PROTO_ROOT} ${_wkt} --cpp_out=${_out}
           ${_files}
      COMMAND protobuf::protoc
      ARGS --proto_path=${MODELAVG_ETCD_PROTO_ROOT} --proto_path=${MODELAVG_GOGO_PROTO_ROOT}
           --proto_path=${MODELAVG_GOOGLEAPIS_PROTO_ROOT} ${_wkt} --grpc_out=${_out}
           --plugin=protoc-gen-grpc=${MODELAVG_GRPC_CPP_PLUGIN}
           etcd/etcdserver/etcdserverpb/rpc.proto
      DEPENDS ${_inputs} protobuf::protoc
      COMMENT "Generating C++ for etcd's v3 API (Debian's golang-etcd-server-dev protos)")
    add_library(modelavg_etcd_proto ${_srcs})
    target_include_directories(modelavg_etcd_proto SYSTEM PUBLIC ${_out})
    target_link_libraries(modelavg_etcd_proto PUBLIC protobuf::libprotobuf gRPC::grpc++)
    set_target_properties(modelavg_etcd_proto PROPERTIES CXX_CLANG_TIDY "")
    set(MODELAVG_HAVE_ETCD ON)
  elseif(MODELAVG_WITH_ETCD STREQUAL "ON")
    message(FATAL_ERROR "MODELAVG_WITH_ETCD=ON but etcd's protos (${MODELAVG_ETCD_PROTO_ROOT}), "
                        "gogoproto (${MODELAVG_GOGO_PROTO_ROOT}) or google/api "
                        "(${MODELAVG_GOOGLEAPIS_PROTO_ROOT}) were not found; install "
                        "golang-etcd-server-dev golang-github-gogo-protobuf-dev "
                        "golang-github-grpc-ecosystem-grpc-gateway-dev or use "
                        "-DMODELAVG_WITH_ETCD=OFF")
  endif()
endif()
