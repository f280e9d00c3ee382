// PKI: the cluster's own certificate authority, serving and client certificates, the
// service-account signing key, and the kubeconfig files that carry them.
package main

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// keyPair is a certificate and its private key, PEM-encoded (keys as PKCS#8, which rustls reads).
type keyPair struct {
	cert    *x509.Certificate
	key     crypto.Signer
	certPEM []byte
	keyPEM  []byte
}

func newKey() (*ecdsa.PrivateKey, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return key, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		panic(err)
	}
	return n
}

// newCA creates a self-signed certificate authority (a real CA: rustls rejects a leaf used as one).
func newCA(cn string) (*keyPair, error) {
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: cn},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	return signed(tmpl, nil)
}

// signed creates the certificate tmpl describes for a new key, signed by issuer (by the new key
// itself when issuer is nil: a self-signed CA).
func signed(tmpl *x509.Certificate, issuer *keyPair) (*keyPair, error) {
	key, keyPEM, err := newKey()
	if err != nil {
		return nil, err
	}
	parent, signer := tmpl, crypto.Signer(key)
	if issuer != nil {
		parent, signer = issuer.cert, issuer.key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, key.Public(), signer)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &keyPair{cert: cert, key: key, certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), keyPEM: keyPEM}, nil
}

// certSpec describes a leaf certificate signed by the CA.
type certSpec struct {
	commonName   string
	organization []string
	dnsNames     []string
	ips          []net.IP
	server       bool
}

func (ca *keyPair) issue(spec certSpec) (*keyPair, error) {
	now := time.Now()
	usage := x509.ExtKeyUsageClientAuth
	if spec.server {
		usage = x509.ExtKeyUsageServerAuth
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: spec.commonName, Organization: spec.organization},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		DNSNames:     spec.dnsNames,
		IPAddresses:  spec.ips,
	}
	return signed(tmpl, ca)
}

// pki is every credential the control plane needs, written under dir/pki.
type pki struct {
	dir string
	ca  *keyPair
}

// Files of the kubelet API: the kubelet serves HTTPS with a certificate of the cluster CA
// (the apiserver verifies it) and accepts only client certificates of a CA of its own, whose one
// certificate the apiserver holds: nothing but the apiserver reaches container logs directly.
const (
	kubeletServingCert     = "kubelet.crt"
	kubeletServingKey      = "kubelet.key"
	kubeletClientCA        = "kubelet-client-ca.crt"
	apiserverKubeletCert   = "apiserver-kubelet-client.crt"
	apiserverKubeletKey    = "apiserver-kubelet-client.key"
	apiserverKubeletClient = "kube-apiserver-kubelet-client"
)

func (p *pki) path(name string) string { return filepath.Join(p.dir, name) }

// generatePKI writes the CA, the apiserver serving pair, the service-account key pair and one
// client pair per identity that "up" hands out.
func generatePKI(dir string) (*pki, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	ca, err := newCA("poolpilot-e2e-ca")
	if err != nil {
		return nil, fmt.Errorf("CA: %w", err)
	}
	p := &pki{dir: dir, ca: ca}
	if err := writeFileAtomic(p.path("ca.crt"), ca.certPEM, 0o644); err != nil {
		return nil, err
	}
	if err := writeFileAtomic(p.path("ca.key"), ca.keyPEM, 0o600); err != nil {
		return nil, err
	}
	serving, err := ca.issue(certSpec{
		commonName: "kube-apiserver",
		dnsNames: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
			"kubernetes.default.svc.cluster.local"},
		ips:    []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("10.96.0.1"), net.ParseIP(hostLinkIP)},
		server: true,
	})
	if err != nil {
		return nil, fmt.Errorf("serving certificate: %w", err)
	}
	if err := p.writePair("apiserver", serving); err != nil {
		return nil, err
	}
	saKey, saPEM, err := newKey()
	if err != nil {
		return nil, err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(saKey.Public())
	if err != nil {
		return nil, err
	}
	if err := writeFileAtomic(p.path("sa.key"), saPEM, 0o600); err != nil {
		return nil, err
	}
	if err := writeFileAtomic(p.path("sa.pub"), pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER}), 0o644); err != nil {
		return nil, err
	}
	clientCA, err := newCA("poolpilot-e2e-kubelet-client-ca")
	if err != nil {
		return nil, fmt.Errorf("kubelet client CA: %w", err)
	}
	if err := writeFileAtomic(p.path(kubeletClientCA), clientCA.certPEM, 0o644); err != nil {
		return nil, err
	}
	apiserverClient, err := clientCA.issue(certSpec{commonName: apiserverKubeletClient})
	if err != nil {
		return nil, fmt.Errorf("apiserver kubelet client certificate: %w", err)
	}
	if err := p.writePair("apiserver-kubelet-client", apiserverClient); err != nil {
		return nil, err
	}
	return p, nil
}

// issueKubelet writes the kubelet's serving pair for node `node` on the addresses its Node
// reports (the node's link address).
func (p *pki) issueKubelet(node string, ips []net.IP) error {
	serving, err := p.ca.issue(certSpec{
		commonName:   "system:node:" + node,
		organization: []string{"system:nodes"},
		dnsNames:     []string{node, "localhost"},
		ips:          ips,
		server:       true,
	})
	if err != nil {
		return fmt.Errorf("kubelet serving certificate: %w", err)
	}
	return p.writePair("kubelet", serving)
}

func (p *pki) writePair(name string, kp *keyPair) error {
	if err := writeFileAtomic(p.path(name+".crt"), kp.certPEM, 0o644); err != nil {
		return err
	}
	return writeFileAtomic(p.path(name+".key"), kp.keyPEM, 0o600)
}

// writeKubeconfig issues a client certificate for user/groups and writes a kubeconfig that
// embeds it together with the CA, atomically.
func (p *pki) writeKubeconfig(path, server, user string, groups []string) error {
	client, err := p.ca.issue(certSpec{commonName: user, organization: groups})
	if err != nil {
		return fmt.Errorf("client certificate for %s: %w", user, err)
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["poolpilot-e2e"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: p.ca.certPEM}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{ClientCertificateData: client.certPEM, ClientKeyData: client.keyPEM}
	cfg.Contexts["poolpilot-e2e"] = &clientcmdapi.Context{Cluster: "poolpilot-e2e", AuthInfo: user, Namespace: "default"}
	cfg.CurrentContext = "poolpilot-e2e"
	data, err := clientcmd.Write(*cfg)
	if err != nil {
		return err
	}
	return writeFileAtomic(path, data, 0o600)
}

// writeFileAtomic writes to a temporary file beside path and renames it into place, so that a
// reader never sees a half-written file.
func writeFileAtomic(path string, data []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
