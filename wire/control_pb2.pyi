from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Gpu(_message.Message):
    __slots__ = ("index", "name", "uuid", "memory_total_bytes", "memory_free_bytes", "driver_version")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    memory_free_bytes: int
    driver_version: str
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., uuid: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., memory_free_bytes: _Optional[int] = ..., driver_version: _Optional[str] = ...) -> None: ...

class Inventory(_message.Message):
    __slots__ = ("hostname", "os", "arch", "cpu_model", "cpu_cores", "ram_total_bytes", "disk_total_bytes", "disk_free_bytes", "gpus", "advertised_address", "rpc_port", "labels", "cpu_threads", "models_free_bytes", "devices", "llama_version", "rpc_protocol", "llama_backend")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    OS_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    CPU_MODEL_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    RAM_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ADVERTISED_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RPC_PORT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CPU_THREADS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    LLAMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    RPC_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    LLAMA_BACKEND_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    os: str
    arch: str
    cpu_model: str
    cpu_cores: int
    ram_total_bytes: int
    disk_total_bytes: int
    disk_free_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    advertised_address: str
    rpc_port: int
    labels: _containers.ScalarMap[str, str]
    cpu_threads: int
    models_free_bytes: int
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    llama_version: str
    rpc_protocol: str
    llama_backend: str
    def __init__(self, hostname: _Optional[str] = ..., os: _Optional[str] = ..., arch: _Optional[str] = ..., cpu_model: _Optional[str] = ..., cpu_cores: _Optional[int] = ..., ram_total_bytes: _Optional[int] = ..., disk_total_bytes: _Optional[int] = ..., disk_free_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., advertised_address: _Optional[str] = ..., rpc_port: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., cpu_threads: _Optional[int] = ..., models_free_bytes: _Optional[int] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., llama_version: _Optional[str] = ..., rpc_protocol: _Optional[str] = ..., llama_backend: _Optional[str] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("name", "description", "kind", "memory_total_bytes", "memory_free_bytes", "uuid")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    kind: str
    memory_total_bytes: int
    memory_free_bytes: int
    uuid: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., kind: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., memory_free_bytes: _Optional[int] = ..., uuid: _Optional[str] = ...) -> None: ...

class DeviceTelemetry(_message.Message):
    __slots__ = ("name", "memory_free_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    memory_free_bytes: int
    def __init__(self, name: _Optional[str] = ..., memory_free_bytes: _Optional[int] = ...) -> None: ...

class LocalModel(_message.Message):
    __slots__ = ("file_name", "path", "size_bytes", "sha256", "parameters", "layers", "context_length", "kv_bytes_per_token", "architecture", "error")
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    file_name: str
    path: str
    size_bytes: int
    sha256: str
    parameters: int
    layers: int
    context_length: int
    kv_bytes_per_token: int
    architecture: str
    error: str
    def __init__(self, file_name: _Optional[str] = ..., path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., parameters: _Optional[int] = ..., layers: _Optional[int] = ..., context_length: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., architecture: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class EnrollRequest(_message.Message):
    __slots__ = ("enrollment_token", "node_name", "agent_version", "inventory")
    ENROLLMENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    enrollment_token: str
    node_name: str
    agent_version: str
    inventory: Inventory
    def __init__(self, enrollment_token: _Optional[str] = ..., node_name: _Optional[str] = ..., agent_version: _Optional[str] = ..., inventory: _Optional[_Union[Inventory, _Mapping]] = ...) -> None: ...

class EnrollResponse(_message.Message):
    __slots__ = ("node_id", "node_credential", "controller_version", "heartbeat_interval_seconds")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_credential: str
    controller_version: str
    heartbeat_interval_seconds: float
    def __init__(self, node_id: _Optional[str] = ..., node_credential: _Optional[str] = ..., controller_version: _Optional[str] = ..., heartbeat_interval_seconds: _Optional[float] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("hello", "heartbeat", "resource_report", "setup_result", "rpc_worker_status", "token_chunk", "job_result", "runtime_fault", "goodbye", "model_transfer", "model_evicted", "model_proof", "stopping", "link_report")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_REPORT_FIELD_NUMBER: _ClassVar[int]
    SETUP_RESULT_FIELD_NUMBER: _ClassVar[int]
    RPC_WORKER_STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHUNK_FIELD_NUMBER: _ClassVar[int]
    JOB_RESULT_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FAULT_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    MODEL_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    MODEL_EVICTED_FIELD_NUMBER: _ClassVar[int]
    MODEL_PROOF_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    LINK_REPORT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    heartbeat: Heartbeat
    resource_report: ResourceReport
    setup_result: SetupResult
    rpc_worker_status: RpcWorkerStatus
    token_chunk: TokenChunk
    job_result: JobResult
    runtime_fault: RuntimeFault
    goodbye: Goodbye
    model_transfer: ModelTransfer
    model_evicted: ModelEvicted
    model_proof: ModelProof
    stopping: Stopping
    link_report: LinkReport
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., resource_report: _Optional[_Union[ResourceReport, _Mapping]] = ..., setup_result: _Optional[_Union[SetupResult, _Mapping]] = ..., rpc_worker_status: _Optional[_Union[RpcWorkerStatus, _Mapping]] = ..., token_chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., job_result: _Optional[_Union[JobResult, _Mapping]] = ..., runtime_fault: _Optional[_Union[RuntimeFault, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ..., model_transfer: _Optional[_Union[ModelTransfer, _Mapping]] = ..., model_evicted: _Optional[_Union[ModelEvicted, _Mapping]] = ..., model_proof: _Optional[_Union[ModelProof, _Mapping]] = ..., stopping: _Optional[_Union[Stopping, _Mapping]] = ..., link_report: _Optional[_Union[LinkReport, _Mapping]] = ...) -> None: ...

class LinkReport(_message.Message):
    __slots__ = ("probe_id", "links")
    PROBE_ID_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    probe_id: str
    links: _containers.RepeatedCompositeFieldContainer[LinkMeasure]
    def __init__(self, probe_id: _Optional[str] = ..., links: _Optional[_Iterable[_Union[LinkMeasure, _Mapping]]] = ...) -> None: ...

class LinkMeasure(_message.Message):
    __slots__ = ("node_id", "rtt_ms", "mbps", "error")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    MBPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    rtt_ms: float
    mbps: float
    error: str
    def __init__(self, node_id: _Optional[str] = ..., rtt_ms: _Optional[float] = ..., mbps: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("agent_version", "node_id", "csr_pem")
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    agent_version: str
    node_id: str
    csr_pem: str
    def __init__(self, agent_version: _Optional[str] = ..., node_id: _Optional[str] = ..., csr_pem: _Optional[str] = ...) -> None: ...

class GpuTelemetry(_message.Message):
    __slots__ = ("index", "memory_free_bytes", "memory_used_bytes", "temperature_c")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    index: int
    memory_free_bytes: int
    memory_used_bytes: int
    temperature_c: float
    def __init__(self, index: _Optional[int] = ..., memory_free_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., temperature_c: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_at_unix_ms", "cpu_percent", "ram_free_bytes", "gpus", "active_job_ids", "devices")
    SENT_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    RAM_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    sent_at_unix_ms: int
    cpu_percent: float
    ram_free_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuTelemetry]
    active_job_ids: _containers.RepeatedScalarFieldContainer[str]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceTelemetry]
    def __init__(self, sent_at_unix_ms: _Optional[int] = ..., cpu_percent: _Optional[float] = ..., ram_free_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuTelemetry, _Mapping]]] = ..., active_job_ids: _Optional[_Iterable[str]] = ..., devices: _Optional[_Iterable[_Union[DeviceTelemetry, _Mapping]]] = ...) -> None: ...

class ResourceReport(_message.Message):
    __slots__ = ("inventory", "models")
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    inventory: Inventory
    models: _containers.RepeatedCompositeFieldContainer[LocalModel]
    def __init__(self, inventory: _Optional[_Union[Inventory, _Mapping]] = ..., models: _Optional[_Iterable[_Union[LocalModel, _Mapping]]] = ...) -> None: ...

class SetupResult(_message.Message):
    __slots__ = ("job_id", "ok", "error", "error_code", "role", "failed_node_id", "failed_device", "failed_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FAILED_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_DEVICE_FIELD_NUMBER: _ClassVar[int]
    FAILED_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    ok: bool
    error: str
    error_code: str
    role: str
    failed_node_id: str
    failed_device: str
    failed_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., error_code: _Optional[str] = ..., role: _Optional[str] = ..., failed_node_id: _Optional[str] = ..., failed_device: _Optional[str] = ..., failed_bytes: _Optional[int] = ...) -> None: ...

class RpcWorkerStatus(_message.Message):
    __slots__ = ("job_id", "state", "host", "port", "error", "error_code", "failed_device", "failed_bytes")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[RpcWorkerStatus.State]
        STARTED: _ClassVar[RpcWorkerStatus.State]
        STOPPED: _ClassVar[RpcWorkerStatus.State]
        FAILED: _ClassVar[RpcWorkerStatus.State]
    STATE_UNSPECIFIED: RpcWorkerStatus.State
    STARTED: RpcWorkerStatus.State
    STOPPED: RpcWorkerStatus.State
    FAILED: RpcWorkerStatus.State
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    FAILED_DEVICE_FIELD_NUMBER: _ClassVar[int]
    FAILED_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: RpcWorkerStatus.State
    host: str
    port: int
    error: str
    error_code: str
    failed_device: str
    failed_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[RpcWorkerStatus.State, str]] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., error: _Optional[str] = ..., error_code: _Optional[str] = ..., failed_device: _Optional[str] = ..., failed_bytes: _Optional[int] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("seq", "text", "tokens", "extra_json")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    text: str
    tokens: int
    extra_json: str
    def __init__(self, seq: _Optional[int] = ..., text: _Optional[str] = ..., tokens: _Optional[int] = ..., extra_json: _Optional[str] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("job_id", "deltas")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    deltas: _containers.RepeatedCompositeFieldContainer[Delta]
    def __init__(self, job_id: _Optional[str] = ..., deltas: _Optional[_Iterable[_Union[Delta, _Mapping]]] = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("job_id", "ok", "finish_reason", "prompt_tokens", "completion_tokens", "time_to_first_token_ms", "tokens_per_second", "error", "error_code", "phase", "output_json", "failed_node_id", "failed_device", "failed_bytes", "cached_prompt_tokens")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_JSON_FIELD_NUMBER: _ClassVar[int]
    FAILED_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_DEVICE_FIELD_NUMBER: _ClassVar[int]
    FAILED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    ok: bool
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float
    tokens_per_second: float
    error: str
    error_code: str
    phase: str
    output_json: str
    failed_node_id: str
    failed_device: str
    failed_bytes: int
    cached_prompt_tokens: int
    def __init__(self, job_id: _Optional[str] = ..., ok: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., time_to_first_token_ms: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., error: _Optional[str] = ..., error_code: _Optional[str] = ..., phase: _Optional[str] = ..., output_json: _Optional[str] = ..., failed_node_id: _Optional[str] = ..., failed_device: _Optional[str] = ..., failed_bytes: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Stopping(_message.Message):
    __slots__ = ("drain_timeout_seconds", "running_job_ids")
    DRAIN_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_JOB_IDS_FIELD_NUMBER: _ClassVar[int]
    drain_timeout_seconds: float
    running_job_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, drain_timeout_seconds: _Optional[float] = ..., running_job_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RuntimeFault(_message.Message):
    __slots__ = ("message", "fatal")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FATAL_FIELD_NUMBER: _ClassVar[int]
    message: str
    fatal: bool
    def __init__(self, message: _Optional[str] = ..., fatal: _Optional[bool] = ...) -> None: ...

class ControllerMessage(_message.Message):
    __slots__ = ("welcome", "execution_plan", "start_rpc_worker", "stop_rpc_worker", "cancel_job", "drain", "resume", "message_rejected", "fetch_model", "evict_model", "nodes_revoked", "rpc_worker_peers", "prove_model", "stop_server", "probe_links")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PLAN_FIELD_NUMBER: _ClassVar[int]
    START_RPC_WORKER_FIELD_NUMBER: _ClassVar[int]
    STOP_RPC_WORKER_FIELD_NUMBER: _ClassVar[int]
    CANCEL_JOB_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_REJECTED_FIELD_NUMBER: _ClassVar[int]
    FETCH_MODEL_FIELD_NUMBER: _ClassVar[int]
    EVICT_MODEL_FIELD_NUMBER: _ClassVar[int]
    NODES_REVOKED_FIELD_NUMBER: _ClassVar[int]
    RPC_WORKER_PEERS_FIELD_NUMBER: _ClassVar[int]
    PROVE_MODEL_FIELD_NUMBER: _ClassVar[int]
    STOP_SERVER_FIELD_NUMBER: _ClassVar[int]
    PROBE_LINKS_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    execution_plan: ExecutionPlan
    start_rpc_worker: StartRpcWorker
    stop_rpc_worker: StopRpcWorker
    cancel_job: CancelJob
    drain: Drain
    resume: Resume
    message_rejected: MessageRejected
    fetch_model: FetchModel
    evict_model: EvictModel
    nodes_revoked: NodesRevoked
    rpc_worker_peers: RpcWorkerPeers
    prove_model: ProveModel
    stop_server: StopServer
    probe_links: ProbeLinks
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., execution_plan: _Optional[_Union[ExecutionPlan, _Mapping]] = ..., start_rpc_worker: _Optional[_Union[StartRpcWorker, _Mapping]] = ..., stop_rpc_worker: _Optional[_Union[StopRpcWorker, _Mapping]] = ..., cancel_job: _Optional[_Union[CancelJob, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., message_rejected: _Optional[_Union[MessageRejected, _Mapping]] = ..., fetch_model: _Optional[_Union[FetchModel, _Mapping]] = ..., evict_model: _Optional[_Union[EvictModel, _Mapping]] = ..., nodes_revoked: _Optional[_Union[NodesRevoked, _Mapping]] = ..., rpc_worker_peers: _Optional[_Union[RpcWorkerPeers, _Mapping]] = ..., prove_model: _Optional[_Union[ProveModel, _Mapping]] = ..., stop_server: _Optional[_Union[StopServer, _Mapping]] = ..., probe_links: _Optional[_Union[ProbeLinks, _Mapping]] = ...) -> None: ...

class ProveModel(_message.Message):
    __slots__ = ("challenge_id", "model_sha256", "nonce", "ranges")
    CHALLENGE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    challenge_id: str
    model_sha256: str
    nonce: bytes
    ranges: _containers.RepeatedCompositeFieldContainer[ByteRange]
    def __init__(self, challenge_id: _Optional[str] = ..., model_sha256: _Optional[str] = ..., nonce: _Optional[bytes] = ..., ranges: _Optional[_Iterable[_Union[ByteRange, _Mapping]]] = ...) -> None: ...

class ByteRange(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ModelProof(_message.Message):
    __slots__ = ("challenge_id", "model_sha256", "digests", "error")
    CHALLENGE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    challenge_id: str
    model_sha256: str
    digests: _containers.RepeatedScalarFieldContainer[bytes]
    error: str
    def __init__(self, challenge_id: _Optional[str] = ..., model_sha256: _Optional[str] = ..., digests: _Optional[_Iterable[bytes]] = ..., error: _Optional[str] = ...) -> None: ...

class NodesRevoked(_message.Message):
    __slots__ = ("node_ids",)
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EvictModel(_message.Message):
    __slots__ = ("model_sha256",)
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    model_sha256: str
    def __init__(self, model_sha256: _Optional[str] = ...) -> None: ...

class ModelEvicted(_message.Message):
    __slots__ = ("model_sha256", "ok", "file_name", "error")
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    model_sha256: str
    ok: bool
    file_name: str
    error: str
    def __init__(self, model_sha256: _Optional[str] = ..., ok: _Optional[bool] = ..., file_name: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class FetchModel(_message.Message):
    __slots__ = ("transfer_id", "model_sha256", "file_name", "size_bytes", "sources", "allowed_source_cidrs")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_SOURCE_CIDRS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    model_sha256: str
    file_name: str
    size_bytes: int
    sources: _containers.RepeatedCompositeFieldContainer[TransferSource]
    allowed_source_cidrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transfer_id: _Optional[str] = ..., model_sha256: _Optional[str] = ..., file_name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[TransferSource, _Mapping]]] = ..., allowed_source_cidrs: _Optional[_Iterable[str]] = ...) -> None: ...

class TransferSource(_message.Message):
    __slots__ = ("node_id", "host", "port", "ticket", "url")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host: str
    port: int
    ticket: str
    url: str
    def __init__(self, node_id: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., ticket: _Optional[str] = ..., url: _Optional[str] = ...) -> None: ...

class ModelTransfer(_message.Message):
    __slots__ = ("transfer_id", "model_sha256", "state", "bytes_done", "size_bytes", "source_node_id", "error")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[ModelTransfer.State]
        STARTED: _ClassVar[ModelTransfer.State]
        PROGRESS: _ClassVar[ModelTransfer.State]
        COMPLETED: _ClassVar[ModelTransfer.State]
        FAILED: _ClassVar[ModelTransfer.State]
    STATE_UNSPECIFIED: ModelTransfer.State
    STARTED: ModelTransfer.State
    PROGRESS: ModelTransfer.State
    COMPLETED: ModelTransfer.State
    FAILED: ModelTransfer.State
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    model_sha256: str
    state: ModelTransfer.State
    bytes_done: int
    size_bytes: int
    source_node_id: str
    error: str
    def __init__(self, transfer_id: _Optional[str] = ..., model_sha256: _Optional[str] = ..., state: _Optional[_Union[ModelTransfer.State, str]] = ..., bytes_done: _Optional[int] = ..., size_bytes: _Optional[int] = ..., source_node_id: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("controller_version", "node_id", "heartbeat_interval_seconds", "resumed_jobs", "node_certificate_pem", "revoked_node_ids")
    CONTROLLER_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_JOBS_FIELD_NUMBER: _ClassVar[int]
    NODE_CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    REVOKED_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    controller_version: str
    node_id: str
    heartbeat_interval_seconds: float
    resumed_jobs: _containers.RepeatedCompositeFieldContainer[ResumedJob]
    node_certificate_pem: str
    revoked_node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, controller_version: _Optional[str] = ..., node_id: _Optional[str] = ..., heartbeat_interval_seconds: _Optional[float] = ..., resumed_jobs: _Optional[_Iterable[_Union[ResumedJob, _Mapping]]] = ..., node_certificate_pem: _Optional[str] = ..., revoked_node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ResumedJob(_message.Message):
    __slots__ = ("job_id", "next_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    next_seq: int
    def __init__(self, job_id: _Optional[str] = ..., next_seq: _Optional[int] = ...) -> None: ...

class RpcPeer(_message.Message):
    __slots__ = ("node_id", "host", "port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host: str
    port: int
    def __init__(self, node_id: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class GenerationParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "stop", "seed", "options_json")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    options_json: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., options_json: _Optional[str] = ...) -> None: ...

class ChatJob(_message.Message):
    __slots__ = ("messages_json", "tools_json")
    MESSAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages_json: str
    tools_json: str
    def __init__(self, messages_json: _Optional[str] = ..., tools_json: _Optional[str] = ...) -> None: ...

class CompletionJob(_message.Message):
    __slots__ = ("text", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: TokenIds
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class EmbeddingJob(_message.Message):
    __slots__ = ("texts", "tokens")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., tokens: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ExecutionPlan(_message.Message):
    __slots__ = ("job_id", "model_name", "model_file_name", "model_sha256", "context_size", "role", "rpc_peers", "tensor_split", "generation", "rpc_port", "parallel", "embeddings", "pooling", "devices", "n_gpu_layers", "chat", "completion", "embedding", "host_bytes")
    class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ROLE_UNSPECIFIED: _ClassVar[ExecutionPlan.Role]
        PRIMARY: _ClassVar[ExecutionPlan.Role]
        WORKER: _ClassVar[ExecutionPlan.Role]
    ROLE_UNSPECIFIED: ExecutionPlan.Role
    PRIMARY: ExecutionPlan.Role
    WORKER: ExecutionPlan.Role
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RPC_PEERS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SPLIT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RPC_PORT_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    N_GPU_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    model_name: str
    model_file_name: str
    model_sha256: str
    context_size: int
    role: ExecutionPlan.Role
    rpc_peers: _containers.RepeatedCompositeFieldContainer[RpcPeer]
    tensor_split: _containers.RepeatedScalarFieldContainer[float]
    generation: GenerationParams
    rpc_port: int
    parallel: int
    embeddings: bool
    pooling: str
    devices: _containers.RepeatedCompositeFieldContainer[PlanDevice]
    n_gpu_layers: int
    chat: ChatJob
    completion: CompletionJob
    embedding: EmbeddingJob
    host_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., model_name: _Optional[str] = ..., model_file_name: _Optional[str] = ..., model_sha256: _Optional[str] = ..., context_size: _Optional[int] = ..., role: _Optional[_Union[ExecutionPlan.Role, str]] = ..., rpc_peers: _Optional[_Iterable[_Union[RpcPeer, _Mapping]]] = ..., tensor_split: _Optional[_Iterable[float]] = ..., generation: _Optional[_Union[GenerationParams, _Mapping]] = ..., rpc_port: _Optional[int] = ..., parallel: _Optional[int] = ..., embeddings: _Optional[bool] = ..., pooling: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[PlanDevice, _Mapping]]] = ..., n_gpu_layers: _Optional[int] = ..., chat: _Optional[_Union[ChatJob, _Mapping]] = ..., completion: _Optional[_Union[CompletionJob, _Mapping]] = ..., embedding: _Optional[_Union[EmbeddingJob, _Mapping]] = ..., host_bytes: _Optional[int] = ...) -> None: ...

class PlanDevice(_message.Message):
    __slots__ = ("node_id", "device", "endpoint", "share", "assigned_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    device: str
    endpoint: str
    share: float
    assigned_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., device: _Optional[str] = ..., endpoint: _Optional[str] = ..., share: _Optional[float] = ..., assigned_bytes: _Optional[int] = ...) -> None: ...

class StartRpcWorker(_message.Message):
    __slots__ = ("job_id", "host", "port", "allowed_peers", "peers", "devices")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_PEERS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    host: str
    port: int
    allowed_peers: _containers.RepeatedScalarFieldContainer[str]
    peers: _containers.RepeatedCompositeFieldContainer[RpcPeerAccess]
    devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., allowed_peers: _Optional[_Iterable[str]] = ..., peers: _Optional[_Iterable[_Union[RpcPeerAccess, _Mapping]]] = ..., devices: _Optional[_Iterable[str]] = ...) -> None: ...

class RpcPeerAccess(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RpcWorkerPeers(_message.Message):
    __slots__ = ("peers", "reason")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[RpcPeerAccess]
    reason: str
    def __init__(self, peers: _Optional[_Iterable[_Union[RpcPeerAccess, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class StopServer(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ProbeLinks(_message.Message):
    __slots__ = ("probe_id", "peers", "probe_bytes")
    PROBE_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    probe_id: str
    peers: _containers.RepeatedCompositeFieldContainer[LinkPeer]
    probe_bytes: int
    def __init__(self, probe_id: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[LinkPeer, _Mapping]]] = ..., probe_bytes: _Optional[int] = ...) -> None: ...

class LinkPeer(_message.Message):
    __slots__ = ("node_id", "host", "port", "ticket")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host: str
    port: int
    ticket: str
    def __init__(self, node_id: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., ticket: _Optional[str] = ...) -> None: ...

class StopRpcWorker(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelJob(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class MessageRejected(_message.Message):
    __slots__ = ("kind", "job_id", "reason")
    KIND_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    job_id: str
    reason: str
    def __init__(self, kind: _Optional[str] = ..., job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Resume(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
