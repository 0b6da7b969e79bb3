"""Reaching the controller: the address and gRPC channel, retries with capped exponential
backoff and jitter (one log line per failed attempt, with the troubleshooting hint), and
enrollment with a token unless ``identity.json`` already holds the node's identity."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from typing import Any, cast

import grpc
import grpc.aio

from agent import AGENT_VERSION
from agent.agent_config import (
    AgentConfig,
    AgentError,
    Backoff,
    ConfigError,
    ControllerTarget,
    EnrollmentRefused,
    Jitter,
    MissingEnrollmentToken,
    parse_controller_url,
)
from agent.control.controller_probe import ControllerIsHttp, http_status_line
from agent.control.controller_tls import (
    ControllerNotVerified,
    PinnedCa,
    checked_token,
    fetch_pinned_ca,
    trusted_server_name,
    verified_server_name,
)
from agent.node.identity import NodeIdentity, load_identity, save_identity
from agent.node.resources import Resources
from common.contract import AGENT_RECEIVE_BYTES, CONTROLLER_TLS_NAME, MAX_CONTROL_MESSAGE_BYTES
from wire import control_pb2 as pb
from wire import control_pb2_grpc as pb_grpc
from wire import keepalive

log = logging.getLogger(__name__)

# The seed's troubleshooting entry for an unreachable control channel.
CONNECTION_HINT = (
    "gRPC connection refused: controller unreachable or control port blocked — verify "
    "controller availability, address, TLS settings and firewall rules"
)

#: What gRPC says of a certificate it could not verify (OpenSSL's reason).
CERTIFICATE_REFUSED = "CERTIFICATE_VERIFY_FAILED"

# Enroll answers that retrying cannot fix.
ENROLL_REFUSED_CODES = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.ALREADY_EXISTS,
    }
)


class ConnectionLost(Exception):
    """One Enroll/Connect attempt failed or an established stream ended."""

    def __init__(self, reason: str, *, unreachable: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unreachable = unreachable


def stub(channel: grpc.aio.Channel) -> Any:
    return pb_grpc.ControlPlaneStub(channel)  # type: ignore[no-untyped-call]


def rpc_failure(exc: grpc.aio.AioRpcError) -> ConnectionLost:
    code = exc.code()
    return ConnectionLost(
        f"{code.name}: {exc.details() or ''}".rstrip(": "),
        unreachable=code == grpc.StatusCode.UNAVAILABLE,
    )


class ControllerChannel:
    """How :class:`agent.control.control_client.AgentSession` reaches the controller: its address,
    the gRPC channel, retries with backoff, and enrollment (or the stored identity)."""

    def __init__(self, config: AgentConfig, jitter: Jitter | None = None) -> None:
        self.config = config
        self._backoff = Backoff(config.backoff_initial, config.backoff_max, jitter)
        self._target: ControllerTarget | None = None
        self._channel: grpc.aio.Channel | None = None
        self._pinned: PinnedCa | None = None
        self.failed_attempts = 0
        self.connections = 0  # streams that reached READY

    @property
    def target(self) -> ControllerTarget:
        """The controller's address (known once :meth:`ensure_identity` returned)."""
        assert self._target is not None
        return self._target

    def connected(self) -> None:
        """A stream reached READY: the backoff starts over."""
        self.connections += 1
        self._backoff.reset()

    def reset_backoff(self) -> None:
        self._backoff.reset()

    async def close(self) -> None:
        """Closes the channel open now, if any."""
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close(None)

    # -- channel ------------------------------------------------------------------------

    def _resolve_target(self, identity: NodeIdentity | None) -> ControllerTarget:
        url = self.config.controller_url or (identity.controller_url if identity else "")
        if not url:
            raise ConfigError("no controller URL: pass --controller-url or set DACP_CONTROLLER_URL")
        return parse_controller_url(url, insecure=self.config.insecure)

    def open_channel(self) -> grpc.aio.Channel:
        target = self._target
        assert target is not None
        options: list[tuple[str, int | str]] = [
            *keepalive.channel_options(
                self.config.keepalive_interval, self.config.keepalive_timeout
            ),
            # A subchannel of its own: gRPC otherwise shares one per address across channels,
            # and a new channel inherits the old one's reconnect backoff (up to 2 minutes),
            # failing each attempt at once without trying; the session has its own backoff.
            ("grpc.use_local_subchannel_pool", 1),
            # A plan carries the whole request (up to the controller's MAX_REQUEST_BYTES).
            ("grpc.max_receive_message_length", AGENT_RECEIVE_BYTES),
            ("grpc.max_send_message_length", MAX_CONTROL_MESSAGE_BYTES),
        ]
        if target.secure:
            root: bytes | None = None
            pinned = self._pinned
            if pinned is not None:
                root = pinned.pem.encode()
                # Trust rests on the pinned CA, and the name is the controller's own: ours,
                # else (an operator's certificate) the URL's host, which gRPC checks unasked.
                if pinned.server_name == CONTROLLER_TLS_NAME:
                    options.append(("grpc.ssl_target_name_override", CONTROLLER_TLS_NAME))
            elif self.config.tls_ca_file is not None:
                try:
                    root = self.config.tls_ca_file.read_bytes()
                except OSError as exc:
                    raise ConfigError(f"cannot read TLS CA file: {exc}") from exc
            credentials = grpc.ssl_channel_credentials(root_certificates=root)
            channel = grpc.aio.secure_channel(target.address, credentials, options=options)
        else:
            channel = grpc.aio.insecure_channel(target.address, options=options)
        self._channel = channel
        return channel

    async def close_channel(self, channel: grpc.aio.Channel) -> None:
        if self._channel is channel:
            self._channel = None
        await channel.close(None)

    async def retry_pause(self, what: str, error: ConnectionLost) -> None:
        """One line per failed attempt (with the troubleshooting hint), then back off. An
        address that answers HTTP is not the control channel, and waiting will not make it
        one: :class:`ControllerIsHttp`, at once. (Asked only until a stream was open: an
        address that took one is the control channel, and a probe would only cost time
        while the link is down.)"""
        target = self._target
        if error.unreachable and target is not None and self.connections == 0:
            status = await asyncio.to_thread(http_status_line, target.host, target.port)
            if status is not None:
                raise ControllerIsHttp(target.url, target.host, status)
        self.failed_attempts += 1
        delay = self._backoff.next_delay()
        log.warning(
            "%s attempt %d failed: %s; retrying in %.2fs — %s (%s)",
            what,
            self._backoff.attempt,
            self._explained(error.reason),
            delay,
            CONNECTION_HINT,
            target.url if target else "?",
        )
        await asyncio.sleep(delay)

    def _explained(self, reason: str) -> str:
        """``reason``, and what a certificate the agent could not verify means here."""
        if CERTIFICATE_REFUSED not in reason:
            return reason
        if self._pinned is not None:
            why = (
                "the controller did not present the CA pinned at enrollment: a controller "
                "set up anew has a new CA (enroll again with a token it mints), or this "
                "address is another controller's"
            )
        elif self.config.tls_ca_file is not None:
            why = f"the controller's certificate does not chain to {self.config.tls_ca_file}"
        else:
            why = (
                "the controller's certificate is not trusted: the enrollment token names no CA "
                "to pin (a token from a controller without TLS?); use a token this controller "
                "mints, or pass --tls-ca-file"
            )
        return f"{why} ({reason})"

    # -- enrollment ---------------------------------------------------------------------

    async def ensure_identity(
        self, resources: Resources
    ) -> tuple[NodeIdentity, pb.EnrollResponse | None]:
        """The node's identity: the stored one (its pin verified), else a new one from
        enrolling with the token (then also the controller's answer)."""
        stored = load_identity(self.config.data_dir)
        self._target = self._resolve_target(stored)
        if stored is not None and stored.controller_ca_pem and self._target.secure:
            stored = await self._verify_stored_pin(stored)
        if stored is not None:
            log.info(
                "using stored identity: node %s (%s), enrolled %s",
                stored.node_id,
                stored.node_name,
                stored.enrolled_at,
            )
            if self.config.enrollment_token:
                log.info("already enrolled; ignoring the enrollment token")
            if stored.controller_url != self._target.url:
                log.warning(
                    "identity was enrolled with controller %s; connecting to %s",
                    stored.controller_url,
                    self._target.url,
                )
            return stored, None
        if not self.config.enrollment_token:
            raise MissingEnrollmentToken(
                f"no enrollment token and no stored identity in {self.config.data_dir}; "
                "pass --enrollment-token or set DACP_ENROLLMENT_TOKEN"
            )
        await self._pin_controller_ca(self.config.enrollment_token)
        return await self._enroll(self.config.enrollment_token, resources)

    async def _verify_stored_pin(self, stored: NodeIdentity) -> NodeIdentity:
        """The stored pin, with a server name the controller is verified under. A name saved
        before the agent checked whose certificate it was shown (it was read from the
        presented certificate, and may be a node's) is derived again, from a controller that
        proves it with a certificate of the pinned CA; until one does, the agent retries with
        the troubleshooting hint and sends its credential nowhere."""
        assert self._target is not None
        target = self._target
        if trusted_server_name(stored.tls_server_name, target.host):
            self._pinned = PinnedCa(stored.controller_ca_pem, stored.tls_server_name)
            return stored
        log.warning(
            "identity.json says to verify the controller as %r, a name read from the "
            "certificate shown at enrollment; verifying %s again",
            stored.tls_server_name,
            target.url,
        )
        while True:
            try:
                name = await asyncio.to_thread(
                    verified_server_name,
                    target.host,
                    target.port,
                    stored.controller_ca_pem,
                    self.config.rpc_timeout,
                )
            except (OSError, ControllerNotVerified) as exc:
                unreachable = not isinstance(exc, ControllerNotVerified)
                await self.retry_pause(
                    "TLS handshake", ConnectionLost(str(exc), unreachable=unreachable)
                )
                continue
            break
        self._pinned = PinnedCa(stored.controller_ca_pem, name)
        verified = dataclasses.replace(stored, tls_server_name=name)
        save_identity(self.config.data_dir, verified)
        log.info("verified the controller as %r; identity.json updated", name)
        return verified

    async def _pin_controller_ca(self, token: str) -> None:
        """Pins the CA the token names, from the chain the controller presents (retried
        while the controller cannot be reached; a controller that presents another CA is
        fatal: :class:`TlsPinMismatch`). A garbled or truncated token is fatal first, before
        anything is sent: :class:`MalformedEnrollmentToken`."""
        assert self._target is not None
        fingerprint = checked_token(token).ca_fingerprint
        if not self._target.secure or fingerprint is None or self.config.tls_ca_file:
            return
        target = self._target
        while True:
            try:
                self._pinned = await asyncio.to_thread(
                    fetch_pinned_ca, target.host, target.port, fingerprint, self.config.rpc_timeout
                )
            except (OSError, ssl.SSLError) as exc:
                await self.retry_pause("TLS handshake", ConnectionLost(str(exc), unreachable=True))
                continue
            log.info(
                "pinned the controller's CA (sha256 %s…), verifying it as %r",
                fingerprint[:16],
                self._pinned.server_name,
            )
            return

    async def _enroll(
        self, token: str, resources: Resources
    ) -> tuple[NodeIdentity, pb.EnrollResponse]:
        """Enrolls with ``token``: the node's new identity (stored), and the controller's
        answer (its version, the heartbeat interval it asks for)."""
        assert self._target is not None
        request = pb.EnrollRequest(
            enrollment_token=token,
            node_name=self.config.node_name,
            agent_version=AGENT_VERSION,
            inventory=resources.inventory.to_proto(),
        )
        while True:
            channel = self.open_channel()
            try:
                rpc_stub = stub(channel)
                log.info("enrolling as %r with %s", self.config.node_name, self._target.url)
                response = cast(
                    pb.EnrollResponse,
                    await rpc_stub.Enroll(request, timeout=self.config.rpc_timeout),
                )
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() in ENROLL_REFUSED_CODES:
                    raise EnrollmentRefused(exc.code(), exc.details() or "") from None
                failure = rpc_failure(exc)
            finally:
                await self.close_channel(channel)
            await self.retry_pause("enroll", failure)
        if not response.node_id or not response.node_credential:
            raise AgentError("controller answered Enroll without a node id or credential")
        pinned = self._pinned
        identity = NodeIdentity.new(
            node_id=response.node_id,
            node_credential=response.node_credential,
            controller_url=self._target.url,
            node_name=self.config.node_name,
            controller_ca_pem=pinned.pem if pinned else "",
            tls_server_name=pinned.server_name if pinned else "",
        )
        path = save_identity(self.config.data_dir, identity)
        self._backoff.reset()
        log.info("enrolled as node %s; identity stored in %s", identity.node_id, path)
        return identity, response
