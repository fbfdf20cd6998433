package api

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
)

// CanonicalHost accepts only ip:port and returns its canonical spelling, so
// "10.0.0.1:080", "[::ffff:10.0.0.1]:80" and "10.0.0.1:80" are one host.
// The server keys every record by it, and the scraper names the pods it
// scrapes by it, so their reports land on the host the gateways route to.
func CanonicalHost(h string) (string, error) {
	if h == "" {
		return "", errors.New("host is required")
	}
	ip, port, err := net.SplitHostPort(h)
	if err != nil {
		return "", fmt.Errorf("host %q is not ip:port: %v", h, err)
	}
	addr, err := netip.ParseAddr(ip)
	if err != nil {
		return "", fmt.Errorf("host %q is not ip:port: %q is not an IP address", h, ip)
	}
	if addr.Zone() != "" {
		return "", fmt.Errorf("host %q is not ip:port: IPv6 zones are not accepted", h)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil || p == 0 {
		return "", fmt.Errorf("host %q is not ip:port: port %q is not in 1..65535", h, port)
	}
	return netip.AddrPortFrom(addr.Unmap(), uint16(p)).String(), nil
}
