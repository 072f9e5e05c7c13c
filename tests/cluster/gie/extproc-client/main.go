// Command extproc-client stands in for an inference gateway (Envoy, Istio, agentgateway)
// in the endpoint-picker test: it speaks Envoy's ext_proc protocol to a GIE endpoint
// picker exactly as a gateway's ext_proc filter does (request headers, then the buffered
// JSON body), and prints the endpoint the picker chose for each request, one per line
// ("<ip>:<port>"), or "error: ..." when the picker refused it.
//
//	extproc-client --addr 127.0.0.1:9002 --n 8 --body '{"model":"m","prompt":"hi"}'
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const destinationHeader = "x-gateway-destination-endpoint"

func main() {
	addr := flag.String("addr", "127.0.0.1:9002", "endpoint picker's ext_proc gRPC address")
	body := flag.String("body", `{"model":"default","prompt":"Hello","max_tokens":1}`, "JSON request body")
	path := flag.String("path", "/v1/completions", "request path")
	n := flag.Int("n", 1, "requests to send")
	timeout := flag.Duration("timeout", 10*time.Second, "per-request timeout")
	flag.Parse()

	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, "dial:", err)
		os.Exit(2)
	}
	defer conn.Close()
	client := extproc.NewExternalProcessorClient(conn)
	for i := 0; i < *n; i++ {
		ep, err := pick(client, *path, []byte(*body), fmt.Sprintf("dspark-gie-test-%d-%d", os.Getpid(), i), *timeout)
		if err != nil {
			fmt.Printf("error: %v\n", strings.ReplaceAll(err.Error(), "\n", " "))
			continue
		}
		fmt.Println(ep)
	}
}

// pick sends one request's headers and body and returns the destination endpoint the
// picker set in its header mutation.
func pick(client extproc.ExternalProcessorClient, path string, body []byte, id string, timeout time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	stream, err := client.Process(ctx)
	if err != nil {
		return "", err
	}
	hdr := func(k, v string) *corev3.HeaderValue { return &corev3.HeaderValue{Key: k, RawValue: []byte(v)} }
	headers := &extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extproc.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			hdr(":method", "POST"), hdr(":path", path), hdr(":authority", "gateway"),
			hdr("content-type", "application/json"), hdr("x-request-id", id),
		}}},
	}}
	if err := stream.Send(headers); err != nil {
		return "", err
	}
	if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{
		RequestBody: &extproc.HttpBody{Body: body, EndOfStream: true},
	}}); err != nil {
		return "", err
	}
	for {
		resp, err := stream.Recv()
		if err == io.EOF {
			return "", fmt.Errorf("stream ended without a destination")
		}
		if err != nil {
			return "", err
		}
		if ir := resp.GetImmediateResponse(); ir != nil {
			return "", fmt.Errorf("immediate response %v: %s", ir.GetStatus().GetCode(), ir.GetBody())
		}
		for _, h := range resp.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
			if h.GetHeader().GetKey() == destinationHeader {
				v := string(h.GetHeader().GetRawValue())
				if v == "" {
					v = h.GetHeader().GetValue()
				}
				_ = stream.CloseSend()
				return v, nil
			}
		}
	}
}
