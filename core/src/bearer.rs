//! `Authorization: Bearer <token>` as the filter's status path and the quota service read it:
//! the scheme in any case (RFC 9110), the token compared in constant time.

/// The token of an `Authorization` value, if its scheme is `Bearer`.
pub fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then_some(token)
}

/// Equal, in time that does not depend on where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scheme_in_any_case_and_the_token_whole() {
        assert_eq!(bearer_token(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"bEaReR abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_token(b"Basic abc"), None);
        assert_eq!(bearer_token(b"Bearer"), None);
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd") && !constant_time_eq(b"abc", b"ab"));
    }
}
