//! Just enough HTTP/1.1 for the testbed: read one message head (and a body by length or chunks).

use std::io::{self, BufRead, Read};

/// A message head: the first line and the headers (names lower-case).
pub struct Head {
    pub first: String,
    pub headers: Vec<(String, String)>,
}

impl Head {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Read a message head; `None` at a clean end of the stream.
pub fn read_head(r: &mut impl BufRead) -> io::Result<Option<Head>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let first = line.trim_end().to_string();
    let mut headers = Vec::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((n, v)) = l.split_once(':') {
            headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    Ok(Some(Head { first, headers }))
}

/// Read and drop the body the head announces.
pub fn skip_body(r: &mut impl BufRead, head: &Head) -> io::Result<()> {
    if let Some(n) = head.header("content-length") {
        let n: u64 = n
            .parse()
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "content-length"))?;
        io::copy(&mut r.take(n), &mut io::sink())?;
        return Ok(());
    }
    if head
        .header("transfer-encoding")
        .is_some_and(|t| t.eq_ignore_ascii_case("chunked"))
    {
        let mut line = String::new();
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let size = u64::from_str_radix(line.trim().split(';').next().unwrap_or("0"), 16)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "chunk size"))?;
            io::copy(&mut r.take(size), &mut io::sink())?;
            line.clear();
            r.read_line(&mut line)?;
            if size == 0 {
                return Ok(());
            }
        }
    }
    Ok(())
}
