//! TLS on the gRPC port, terminated here rather than inside tonic so that the plaintext HTTP/2
//! passes [`super::authority`] on its way to the server: an Istio picker reached over TLS sends
//! the same illegal `outbound|…` authority as one reached in plaintext.
//!
//! The handshake runs on the connection's first read or write, in the connection's own task, so a
//! slow client delays nobody else; the connection guard's handshake deadline bounds it as before.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use anyhow::Context as _;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_rustls::server::TlsStream;
use tokio_rustls::{Accept, TlsAcceptor};
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::config::GrpcTlsConfig;

/// The acceptor for `server.tls`; `None` when the port is plaintext. Fails when a file cannot
/// be read or used.
pub(crate) fn acceptor(tls: &GrpcTlsConfig) -> anyhow::Result<Option<TlsAcceptor>> {
    let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) else {
        return Ok(None);
    };
    let read = |what: &str, path: &str| {
        std::fs::read(path).with_context(|| format!("server.tls.{what}: cannot read {path}"))
    };
    let certs = CertificateDer::pem_slice_iter(&read("cert_file", cert)?)
        .collect::<Result<Vec<_>, _>>()
        .context("server.tls.cert_file: not a PEM certificate chain")?;
    anyhow::ensure!(
        !certs.is_empty(),
        "server.tls.cert_file: no certificate in {cert}"
    );
    let key = PrivateKeyDer::from_pem_slice(&read("key_file", key)?)
        .context("server.tls.key_file: no PEM private key")?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("server.tls: no TLS version available")?;
    let builder = match &tls.client_ca_file {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(&read("client_ca_file", ca)?) {
                roots
                    .add(c.context("server.tls.client_ca_file: not a PEM certificate")?)
                    .context("server.tls.client_ca_file: not a usable CA certificate")?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .context("server.tls.client_ca_file: no usable CA certificate")?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .context("server.tls: the certificate or key is not usable")?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Some(TlsAcceptor::from(Arc::new(config))))
}

enum State<S> {
    Plain(S),
    Handshake(Box<Accept<S>>),
    Tls(Box<TlsStream<S>>),
    Failed,
}

/// A connection that is plaintext, or TLS once its handshake (driven by the first read or write)
/// is done.
pub struct MaybeTls<S> {
    state: State<S>,
    info: TcpConnectInfo,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Connected<ConnectInfo = TcpConnectInfo>> MaybeTls<S> {
    /// Plaintext without an acceptor.
    pub fn new(io: S, acceptor: Option<&TlsAcceptor>) -> Self {
        let info = io.connect_info();
        let state = match acceptor {
            None => State::Plain(io),
            Some(a) => State::Handshake(Box::new(a.accept(io))),
        };
        Self { state, info }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> MaybeTls<S> {
    /// Drives the handshake; ready once the connection can carry bytes (or has failed).
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let State::Handshake(accept) = &mut self.state {
            match ready!(Pin::new(accept.as_mut()).poll(cx)) {
                Ok(tls) => self.state = State::Tls(Box::new(tls)),
                Err(e) => {
                    self.state = State::Failed;
                    return Poll::Ready(Err(e));
                }
            }
        }
        match self.state {
            State::Failed => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "TLS handshake failed",
            ))),
            _ => Poll::Ready(Ok(())),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for MaybeTls<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_ready(cx))?;
        match &mut this.state {
            State::Plain(s) => Pin::new(s).poll_read(cx, buf),
            State::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            State::Handshake(_) | State::Failed => Poll::Ready(Ok(())),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for MaybeTls<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_ready(cx))?;
        match &mut this.state {
            State::Plain(s) => Pin::new(s).poll_write(cx, buf),
            State::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            State::Handshake(_) | State::Failed => Poll::Ready(Ok(0)),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_ready(cx))?;
        match &mut this.state {
            State::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            State::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            State::Handshake(_) | State::Failed => Poll::Ready(Ok(0)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.state {
            State::Plain(s) => s.is_write_vectored(),
            State::Tls(s) => s.is_write_vectored(),
            State::Handshake(_) | State::Failed => false,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match &mut this.state {
            State::Plain(s) => Pin::new(s).poll_flush(cx),
            State::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            State::Handshake(_) | State::Failed => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match &mut this.state {
            State::Plain(s) => Pin::new(s).poll_shutdown(cx),
            State::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            State::Handshake(_) | State::Failed => Poll::Ready(Ok(())),
        }
    }
}

impl<S> Connected for MaybeTls<S> {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.info.clone()
    }
}
