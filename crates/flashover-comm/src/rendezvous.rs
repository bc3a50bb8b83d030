//! A TCP rendezvous that lets no one in: how processes started without MPI (torchrun-style
//! variables) exchange the few bytes they need to build a real engine (NCCL's unique id).
//!
//! Rank 0 listens on the configured address only; every other rank connects and presents a
//! hello frame: the job's token (shared through the environment by whoever started the job),
//! its rank and its blob. When every rank has joined, rank 0 answers each with every rank's
//! blob, in rank order: an all-gather of small blobs.
//!
//! Everything a peer sends is untrusted: frames start with a magic and a version, their
//! length is bounded before anything is allocated, tokens are compared in full, ranks must be
//! in range and not yet joined. A peer that sends garbage, an oversized frame, a wrong token or
//! nothing at all (a half-open connection) is rejected by name (its address) without stopping
//! the others; each connection is read on its own thread with a deadline, so a silent peer
//! holds nobody up. If the world is not complete by the deadline, the error lists the ranks
//! that never joined and every rejection.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const MAGIC: &[u8; 4] = b"FLRV";
const VERSION: u8 = 1;
/// The largest frame accepted (a hello with a token and a blob, or the answer).
pub const MAX_FRAME: usize = 1 << 20;
/// The largest blob a rank may contribute.
pub const MAX_BLOB: usize = 4096;
/// The most connections read at once (bounds the threads a flood of connections can start).
const MAX_PENDING: usize = 64;

/// Why a rendezvous failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RendezvousError {
    /// Binding, connecting or another socket operation failed.
    #[error("rendezvous at {addr}: {detail}")]
    Io {
        /// The address involved.
        addr: String,
        /// What failed.
        detail: String,
    },
    /// Not every rank joined before the deadline.
    #[error("rendezvous at {addr} timed out after {waited:?}: ranks {missing:?} did not join{}", rejected_list(.rejected))]
    Timeout {
        /// The listening address.
        addr: String,
        /// Ranks that never joined.
        missing: Vec<usize>,
        /// Peers turned away, each with the reason.
        rejected: Vec<String>,
        /// How long rank 0 waited.
        waited: Duration,
    },
    /// The peer (rank 0, seen from a joining rank) sent something unexpected.
    #[error("rendezvous: {peer} sent an invalid reply: {detail}")]
    BadReply {
        /// The peer's address.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// This rank's own arguments are invalid.
    #[error("rendezvous: {0}")]
    Invalid(String),
}

fn rejected_list(rejected: &[String]) -> String {
    if rejected.is_empty() {
        String::new()
    } else {
        format!("; rejected: {}", rejected.join("; "))
    }
}

/// A job's rendezvous: where rank 0 listens, the token every rank must present, the number of
/// ranks and how long to wait.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    /// Rank 0's address.
    pub addr: SocketAddr,
    /// The job's secret (from the environment).
    pub token: String,
    /// Number of ranks.
    pub world: usize,
    /// How long to wait for everyone.
    pub timeout: Duration,
}

/// Writes one frame: magic, version, length (u32 LE), payload.
fn write_frame(stream: &mut TcpStream, payload: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(9 + payload.len());
    frame.extend_from_slice(MAGIC);
    frame.push(VERSION);
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(payload);
    stream.write_all(&frame)
}

/// Reads one frame, checking magic, version and the length bound before allocating.
fn read_frame(stream: &mut TcpStream, deadline: Instant) -> Result<Vec<u8>, String> {
    let remaining = deadline.saturating_duration_since(Instant::now());
    if remaining.is_zero() {
        return Err("no frame before the deadline".into());
    }
    stream
        .set_read_timeout(Some(remaining))
        .map_err(|e| e.to_string())?;
    let mut head = [0u8; 9];
    stream.read_exact(&mut head).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            "sent no complete frame header before the deadline (half-open?)".to_string()
        }
        std::io::ErrorKind::UnexpectedEof => "closed the connection mid-frame".to_string(),
        _ => e.to_string(),
    })?;
    if &head[..4] != MAGIC {
        return Err(format!(
            "not a rendezvous frame (starts {:02x?})",
            &head[..4]
        ));
    }
    if head[4] != VERSION {
        return Err(format!("frame version {} (expected {VERSION})", head[4]));
    }
    let len = u32::from_le_bytes(head[5..9].try_into().expect("4 bytes")) as usize;
    if len > MAX_FRAME {
        return Err(format!("a frame of {len} bytes (at most {MAX_FRAME})"));
    }
    let mut payload = vec![0u8; len];
    stream
        .read_exact(&mut payload)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                "sent a partial frame and then nothing before the deadline".to_string()
            }
            _ => e.to_string(),
        })?;
    Ok(payload)
}

/// A little-endian reader over a payload that fails instead of panicking.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "payload ends early ({} bytes left, {n} needed)",
                self.0.len()
            ));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn bytes(&mut self, max: usize, what: &str) -> Result<&'a [u8], String> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(format!("{what} of {len} bytes (at most {max})"));
        }
        self.take(len)
    }
    fn end(&self) -> Result<(), String> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(format!("{} unexpected trailing bytes", self.0.len()))
        }
    }
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Equal without an early exit on the first differing byte.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Rendezvous {
    fn check(&self, rank: usize, blob: &[u8]) -> Result<(), RendezvousError> {
        if rank >= self.world {
            return Err(RendezvousError::Invalid(format!(
                "rank {rank} of a world of {}",
                self.world
            )));
        }
        if blob.len() > MAX_BLOB {
            return Err(RendezvousError::Invalid(format!(
                "a blob of {} bytes (at most {MAX_BLOB})",
                blob.len()
            )));
        }
        if self.token.len() < 16 {
            return Err(RendezvousError::Invalid(
                "the job token must have at least 16 characters".into(),
            ));
        }
        Ok(())
    }

    /// Rank 0: listens on `addr` (only there), accepts every other rank's hello, and answers
    /// each with all blobs. Returns all blobs in rank order.
    pub fn serve(&self, blob: &[u8]) -> Result<Vec<Vec<u8>>, RendezvousError> {
        let listener = TcpListener::bind(self.addr).map_err(|e| RendezvousError::Io {
            addr: self.addr.to_string(),
            detail: format!("bind: {e}"),
        })?;
        self.serve_on(listener, blob)
    }

    /// [`Rendezvous::serve`] on a listener already bound (tests bind port 0).
    pub fn serve_on(
        &self,
        listener: TcpListener,
        blob: &[u8],
    ) -> Result<Vec<Vec<u8>>, RendezvousError> {
        self.check(0, blob)?;
        let started = Instant::now();
        let deadline = started + self.timeout;
        let addr = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| self.addr.to_string());
        let io = |detail: String| RendezvousError::Io {
            addr: addr.clone(),
            detail,
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| io(e.to_string()))?;
        let mut blobs: Vec<Option<Vec<u8>>> = vec![None; self.world];
        blobs[0] = Some(blob.to_vec());
        let mut joined: Vec<Option<TcpStream>> = (0..self.world).map(|_| None).collect();
        let mut rejected = vec![];
        let (tx, rx) = mpsc::channel::<(SocketAddr, TcpStream, Result<(usize, Vec<u8>), String>)>();
        let mut pending = 0usize;
        while blobs.iter().any(Option::is_none) {
            if Instant::now() >= deadline {
                return Err(RendezvousError::Timeout {
                    addr,
                    missing: (0..self.world).filter(|&r| blobs[r].is_none()).collect(),
                    rejected,
                    waited: started.elapsed(),
                });
            }
            // New connections: each read on its own thread, with the deadline.
            match listener.accept() {
                Ok((stream, peer)) if pending < MAX_PENDING => {
                    pending += 1;
                    let (tx, token, world) = (tx.clone(), self.token.clone(), self.world);
                    std::thread::spawn(move || {
                        let mut stream = stream;
                        // Accepted sockets must block (with the read deadline).
                        let _ = stream.set_nonblocking(false);
                        let hello = read_hello(&mut stream, deadline, &token, world);
                        let _ = tx.send((peer, stream, hello));
                    });
                }
                Ok((_, peer)) => rejected.push(format!("{peer}: too many connections at once")),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => rejected.push(format!("accept: {e}")),
            }
            // Hellos read so far.
            while let Ok((peer, stream, hello)) = rx.try_recv() {
                pending -= 1;
                match hello {
                    Ok((rank, _)) if rank == 0 || blobs[rank].is_some() => {
                        rejected.push(format!("{peer}: rank {rank} has already joined"))
                    }
                    Ok((rank, b)) => {
                        blobs[rank] = Some(b);
                        joined[rank] = Some(stream);
                    }
                    Err(reason) => rejected.push(format!("{peer}: {reason}")),
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let all: Vec<Vec<u8>> = blobs.into_iter().map(|b| b.expect("all joined")).collect();
        let mut answer = vec![];
        for b in &all {
            put_bytes(&mut answer, b);
        }
        for (rank, stream) in joined.iter_mut().enumerate() {
            if let Some(stream) = stream {
                write_frame(stream, &answer)
                    .map_err(|e| io(format!("answering rank {rank}: {e}")))?;
            }
        }
        Ok(all)
    }

    /// Rank `rank` > 0: connects to rank 0 (retrying until the deadline, as it may not listen
    /// yet), presents the token and `blob`, and returns every rank's blob.
    pub fn join(&self, rank: usize, blob: &[u8]) -> Result<Vec<Vec<u8>>, RendezvousError> {
        self.check(rank, blob)?;
        if rank == 0 {
            return Err(RendezvousError::Invalid(
                "rank 0 serves; it does not join".into(),
            ));
        }
        let deadline = Instant::now() + self.timeout;
        let peer = self.addr.to_string();
        let mut stream = loop {
            match TcpStream::connect_timeout(&self.addr, Duration::from_millis(500)) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(RendezvousError::Io {
                        addr: peer,
                        detail: format!("connect: {e}"),
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let mut hello = vec![];
        put_bytes(&mut hello, self.token.as_bytes());
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        put_bytes(&mut hello, blob);
        write_frame(&mut stream, &hello).map_err(|e| RendezvousError::Io {
            addr: peer.clone(),
            detail: format!("sending the hello: {e}"),
        })?;
        let bad = |detail: String| RendezvousError::BadReply {
            peer: peer.clone(),
            detail,
        };
        let answer = read_frame(&mut stream, deadline).map_err(bad)?;
        let mut c = Cursor(&answer);
        let blobs = (0..self.world)
            .map(|_| c.bytes(MAX_BLOB, "a blob").map(<[u8]>::to_vec))
            .collect::<Result<Vec<_>, _>>()
            .map_err(bad)?;
        c.end().map_err(bad)?;
        Ok(blobs)
    }
}

/// Reads and checks a hello: token, rank in range, blob bounded, nothing else.
fn read_hello(
    stream: &mut TcpStream,
    deadline: Instant,
    token: &str,
    world: usize,
) -> Result<(usize, Vec<u8>), String> {
    let payload = read_frame(stream, deadline)?;
    let mut c = Cursor(&payload);
    let presented = c.bytes(1024, "a token")?;
    if !same_secret(presented, token.as_bytes()) {
        return Err("wrong job token".into());
    }
    let rank = c.u32()? as usize;
    if rank >= world {
        return Err(format!("rank {rank} is outside a world of {world}"));
    }
    let blob = c.bytes(MAX_BLOB, "a blob")?.to_vec();
    c.end()?;
    Ok((rank, blob))
}
