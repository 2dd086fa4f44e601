//! A loopback TCP proxy before a Redis port, for the tests that delay, hold or cut a link:
//! it forwards each connection it accepts to the server, and a [`Twist`] decides what
//! becomes of each chunk it reads on the way.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

/// The side of a proxied connection a chunk was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// The client's: the chunk goes to the server.
    Client,
    /// The server's: the chunk goes to the client.
    Server,
}

/// What the proxy does with what it read from one side of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Writes the chunk to the other side; at the end of the stream, stops that way and
    /// shuts down writing to the other side (the other way goes on).
    Forward,
    /// Waits, then does as [`Step::Forward`].
    Delay(Duration),
    /// Forwards nothing more that way and reads nothing more from the side, and keeps both
    /// sockets open, as a middlebox that drops a flow's packets does (no reset, no close);
    /// the other way goes on, and the connection stays open until it cuts it.
    Hold,
    /// Writes the chunk to the other side (whatever becomes of the write), waits for the
    /// duration (while the other way goes on), and closes the connection both ways.
    Cut(Duration),
}

/// What a [`proxy`] does with the connections it accepts and the chunks it reads.
pub(crate) trait Twist: Send + Sync + 'static {
    /// Whether to forward a connection just accepted: one it does not is closed at once,
    /// before the proxy connects to the server.
    fn admit(&self) -> bool {
        true
    }

    /// Connection `n` is connected to the server: the proxy numbers the connections it
    /// forwards from 0, in the order it accepts them.
    fn connected(&self, _n: usize) {}

    /// What to do with `read`, read from `from` on connection `n`: a chunk, or `None` when
    /// that way ends (the side closed, or reading from it or writing to the other failed).
    fn step(&self, n: usize, from: Side, read: Option<&[u8]>) -> Step;
}

impl<F> Twist for F
where
    F: Fn(usize, Side, Option<&[u8]>) -> Step + Send + Sync + 'static,
{
    fn step(&self, n: usize, from: Side, read: Option<&[u8]>) -> Step {
        self(n, from, read)
    }
}

/// A TCP proxy on a free loopback port to the server at `port` on the loopback: it accepts
/// connections, connects each one it admits to the server (closing it if it cannot), and
/// copies bytes both ways, each chunk read as `twist` says. Returns the proxy's port.
pub(crate) async fn proxy(port: u16, twist: impl Twist) -> u16 {
    let twist = Arc::new(twist);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a free port");
    let local = listener.local_addr().expect("an address").port();
    tokio::spawn(async move {
        let mut forwarded = 0;
        while let Ok((client, _)) = listener.accept().await {
            if !twist.admit() {
                continue; // closed at once
            }
            let Ok(server) = TcpStream::connect(("127.0.0.1", port)).await else {
                continue;
            };
            let n = forwarded;
            forwarded += 1;
            twist.connected(n);
            let twist = twist.clone();
            tokio::spawn(async move {
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                // Either way's cut drops the other, and with it the connection's sockets.
                let _ = tokio::try_join!(
                    one_way(cr, sw, &*twist, n, Side::Client),
                    one_way(sr, cw, &*twist, n, Side::Server),
                );
            });
        }
    });
    local
}

/// The connection is cut both ways.
struct Cut;

/// Copies what `from` reads to `to`, each chunk as `twist` says, until that way ends
/// (`Ok`, its sockets' halves dropped) or the connection is cut (`Err`).
async fn one_way(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    twist: &impl Twist,
    n: usize,
    side: Side,
) -> Result<(), Cut> {
    let mut buf = vec![0u8; 65536];
    let mut ended = false;
    loop {
        let read = if ended {
            None
        } else {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => None,
                Ok(len) => Some(&buf[..len]),
            }
        };
        match twist.step(n, side, read) {
            Step::Hold => std::future::pending().await,
            Step::Cut(after) => {
                if let Some(chunk) = read {
                    let _ = to.write_all(chunk).await;
                }
                if !after.is_zero() {
                    tokio::time::sleep(after).await;
                }
                return Err(Cut);
            }
            step @ (Step::Forward | Step::Delay(_)) => {
                if let Step::Delay(delay) = step {
                    tokio::time::sleep(delay).await;
                }
                let Some(chunk) = read else {
                    return Ok(());
                };
                // A failed write ends that way, as the twist says.
                ended = to.write_all(chunk).await.is_err();
            }
        }
    }
}
