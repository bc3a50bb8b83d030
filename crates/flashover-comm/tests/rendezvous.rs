//! The TCP rendezvous: ranks exchange blobs; hostile peers (garbage, oversized frames, wrong
//! tokens, half-open connections, duplicate or out-of-range ranks) are turned away by name
//! without crashing or holding up the job; a missing rank is a named timeout, never a hang.

use flashover_comm::{Rendezvous, RendezvousError};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

const TOKEN: &str = "0123456789abcdef-test-token";

fn rendezvous(listener: &TcpListener, world: usize, timeout: Duration) -> Rendezvous {
    Rendezvous {
        addr: listener.local_addr().unwrap(),
        token: TOKEN.into(),
        world,
        timeout,
    }
}

fn blob(rank: usize) -> Vec<u8> {
    vec![rank as u8; 10 + rank]
}

/// A raw hello frame (for forging bad ones).
fn frame(payload: &[u8]) -> Vec<u8> {
    let mut f = b"FLRV\x01".to_vec();
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(payload);
    f
}

fn hello(token: &str, rank: u32, blob: &[u8]) -> Vec<u8> {
    let mut p = vec![];
    p.extend_from_slice(&(token.len() as u32).to_le_bytes());
    p.extend_from_slice(token.as_bytes());
    p.extend_from_slice(&rank.to_le_bytes());
    p.extend_from_slice(&(blob.len() as u32).to_le_bytes());
    p.extend_from_slice(blob);
    frame(&p)
}

#[test]
fn every_rank_gets_every_blob_in_rank_order() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let rdzv = rendezvous(&listener, 4, Duration::from_secs(20));
    let want: Vec<Vec<u8>> = (0..4).map(blob).collect();
    std::thread::scope(|s| {
        let joiners: Vec<_> = (1..4)
            .map(|r| {
                let rdzv = rdzv.clone();
                s.spawn(move || rdzv.join(r, &blob(r)).unwrap())
            })
            .collect();
        assert_eq!(rdzv.serve_on(listener, &blob(0)).unwrap(), want);
        for j in joiners {
            assert_eq!(j.join().unwrap(), want);
        }
    });
}

#[test]
fn hostile_peers_are_turned_away_and_the_job_still_forms() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let rdzv = rendezvous(&listener, 3, Duration::from_secs(20));
    std::thread::scope(|s| {
        // The attackers first, holding their connections open.
        let attacks = s.spawn(move || {
            let mut held = vec![];
            let mut send = |bytes: &[u8]| {
                let mut c = TcpStream::connect(addr).unwrap();
                let _ = c.write_all(bytes);
                held.push(c);
            };
            send(b"GET / HTTP/1.1\r\n\r\n");
            send(&{
                let mut f = b"FLRV\x01".to_vec();
                f.extend_from_slice(&u32::MAX.to_le_bytes());
                f
            });
            send(&hello("not-the-token-at-all!", 1, b"x"));
            send(&hello(TOKEN, 9, b"x"));
            send(&hello(TOKEN, 1, &vec![0u8; 100_000]));
            send(b""); // half-open: connects, says nothing
            send(&hello(TOKEN, 1, b"x")[..12]); // a partial frame
            std::thread::sleep(Duration::from_secs(3));
            drop(held);
        });
        std::thread::sleep(Duration::from_millis(200));
        let joiners: Vec<_> = (1..3)
            .map(|r| {
                let rdzv = rdzv.clone();
                s.spawn(move || rdzv.join(r, &blob(r)).unwrap())
            })
            .collect();
        let t = Instant::now();
        let all = rdzv.serve_on(listener, &blob(0)).unwrap();
        assert_eq!(all, (0..3).map(blob).collect::<Vec<_>>());
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "silent peers held the job up"
        );
        for j in joiners {
            j.join().unwrap();
        }
        attacks.join().unwrap();
    });
}

#[test]
fn a_missing_rank_times_out_naming_it_and_every_rejection() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let rdzv = rendezvous(&listener, 3, Duration::from_secs(2));
    let err = std::thread::scope(|s| {
        let rdzv2 = rdzv.clone();
        s.spawn(move || {
            // Rank 1 joins (and then fails reading the answer that never comes); a peer with a
            // wrong token and one with garbage are rejected; rank 2 never comes.
            let _ = rdzv2.join(1, &blob(1));
        });
        s.spawn(move || {
            let mut c = TcpStream::connect(addr).unwrap();
            c.write_all(&hello("a-wrong-token-of-some-length", 2, b"x"))
                .unwrap();
            let mut g = TcpStream::connect(addr).unwrap();
            g.write_all(b"\x00\x01\x02\x03garbage garbage").unwrap();
            std::thread::sleep(Duration::from_secs(3));
        });
        rdzv.serve_on(listener, &blob(0)).unwrap_err()
    });
    match &err {
        RendezvousError::Timeout {
            missing, rejected, ..
        } => {
            assert_eq!(missing, &vec![2]);
            let text = rejected.join("; ");
            assert!(text.contains("wrong job token"), "{text}");
            assert!(text.contains("not a rendezvous frame"), "{text}");
            assert!(text.contains("127.0.0.1:"), "peers are named: {text}");
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(err.to_string().contains("ranks [2] did not join"), "{err}");
}

#[test]
fn a_joiner_refuses_a_forged_answer_and_bad_arguments() {
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let rdzv = rendezvous(&fake, 2, Duration::from_secs(5));
    std::thread::scope(|s| {
        s.spawn(move || {
            let (mut c, _) = fake.accept().unwrap();
            // An answer claiming a 1 GiB blob.
            let mut p = vec![];
            p.extend_from_slice(&(1u32 << 30).to_le_bytes());
            c.write_all(&frame(&p)).unwrap();
            std::thread::sleep(Duration::from_millis(500));
        });
        let err = rdzv.join(1, b"mine").unwrap_err().to_string();
        assert!(
            err.contains("invalid reply") && err.contains("at most"),
            "{err}"
        );
    });
    assert!(matches!(
        rdzv.join(5, b""),
        Err(RendezvousError::Invalid(_))
    ));
    let short = Rendezvous {
        token: "short".into(),
        ..rdzv.clone()
    };
    assert!(matches!(
        short.join(1, b""),
        Err(RendezvousError::Invalid(_))
    ));
}
